"""Composer models for the examples: the byte-level GPT, and a next-byte classifier.

Both train on windows of the standard library's source (:class:`RandomWindows`).
Importing this module needs ``mosaicml`` (the ``composer`` extra).
"""

from __future__ import annotations

from typing import Any

import torch
from composer.metrics import LanguageCrossEntropy
from composer.models import ComposerClassifier, ComposerModel
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_dash.showcase.tiny_gpt import TinyGPT


class ComposerTinyGPT(ComposerModel):
    """:class:`TinyGPT` as a ComposerModel: batches are ``(tokens, next_tokens)``;
    evaluation reports ``LanguageCrossEntropy`` (mean next-byte cross-entropy)."""

    def __init__(self, context: int = 64, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.model = TinyGPT(context=context, width=width, depth=depth, heads=heads)
        self.val_cross_entropy = LanguageCrossEntropy()

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self.model(batch[0])

    def loss(self, outputs: Tensor, batch: tuple[Tensor, Tensor], *args: Any, **kwargs: Any) -> Tensor:
        return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), batch[1].reshape(-1))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        return {} if is_train else {"LanguageCrossEntropy": self.val_cross_entropy}

    def update_metric(self, batch: tuple[Tensor, Tensor], outputs: Tensor, metric: Metric) -> None:
        metric.update(outputs, batch[1])


def next_byte_classifier(context: int = 16, embedding: int = 16, hidden: int = 64) -> ComposerClassifier:
    """An MLP that reads ``context`` bytes and predicts the next one (256 classes).
    Its batches are ``(tokens, next_byte)``; see :func:`last_target`."""
    module = nn.Sequential(
        nn.Embedding(256, embedding),
        nn.Flatten(),
        nn.Linear(context * embedding, hidden),
        nn.GELU(),
        nn.Linear(hidden, 256),
    )
    return ComposerClassifier(module, num_classes=256)


def last_target(batch: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Collate ``(tokens, next_tokens)`` windows into ``(tokens, next byte after the window)``."""
    tokens = torch.stack([tokens for tokens, _ in batch])
    targets = torch.stack([targets[-1] for _, targets in batch])
    return tokens, targets

"""A small decoder-only transformer over bytes, for the examples and benchmarks."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TinyGPT(nn.Module):
    """Byte embedding, pre-norm causal transformer blocks, untied output head."""

    def __init__(self, context: int = 64, width: int = 64, depth: int = 2, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        hidden = self.token(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

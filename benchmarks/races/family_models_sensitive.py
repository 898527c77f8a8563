"""Six more families for ``families.py``, written down before any DASH run on them: the two kinds of model
on which a default chosen on the first fourteen families lost when a new user tried it.

Recurrent language models at their AdamW's high learning rate, where a step that is too large in
every direction makes the recurrence explode:

- ``lstm``: a two-layer byte-level LSTM (embedding 64, hidden 192) on stdlib source, on an lr grid
  around 3e-2 (Adam's stable range for recurrent models reaches far higher lrs than a
  transformer's).
- ``rnn_clipped``: an Elman RNN (``tanh``, hidden 256) byte-level on English text, trained as RNN
  users write it: Lightning's ``gradient_clip_val=1.0``.

Classifiers whose validation loss is dominated by a few confident errors (near-perfect accuracy;
an optimizer that fits the training set faster makes its few mistakes with more confidence):

- ``cnn_long``: the suite's digits CNN (batch norm) at three times its steps (450, about 20
  epochs of the 1,400 training images).
- ``lenet``: a LeNet-style CNN without normalisation (two 3x3 convolutions, max pooling, two
  linear layers) on the digits, 400 steps.
- ``mlp_digits``: a three-layer ReLU MLP on the flattened 8x8 digits, 400 steps.
- ``tabular_classifier``: a two-hidden-layer MLP telling benign from malignant tumours in
  scikit-learn's breast-cancer data (455 training / 114 validation rows, 30 standardised
  features), 300 steps.

Same protocol as the rest: AdamW with warm-up + cosine, its lr tuned per family on the grid; the
classifiers also record their validation accuracy.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules

from family_models import (
    ADAM,
    LRS_HIGH,
    LRS_MID,
    DigitsCNN,
    Family,
    cross_entropy,
    digits,
    english,
    stdlib,
)


class ByteLSTM(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 192, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.lstm = nn.LSTM(width, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


class ByteRNN(nn.Module):
    """An Elman RNN: ``h_t = tanh(W x_t + U h_(t-1) + b)``, the recurrence most prone to explode."""

    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.rnn = nn.RNN(width, hidden, nonlinearity="tanh", batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


class LeNet(nn.Module):
    """Two 3x3 convolutions with ReLU and 2x2 max pooling, then two linear layers; no normalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images))


def relu_mlp(features: int, classes: int, hidden: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, classes))


@functools.cache
def breast_cancer() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """scikit-learn's breast-cancer data: rows shuffled with a fixed seed, 455 for training, the
    features standardised with the training rows' statistics; labels 0 (malignant) and 1 (benign)."""
    from sklearn.datasets import load_breast_cancer

    features, labels = load_breast_cancer(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(labels)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:455], order[455:]
    mean, std = x[train].mean(0), x[train].std(0)
    return ((x[train] - mean) / std, y[train]), ((x[val] - mean) / std, y[val])


def accuracy(net: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    """The share of rows whose largest logit is the label's."""
    inputs, targets = batch
    return (net(inputs).argmax(-1) == targets).float().mean()


#: The recurrent families' grid: the GRU family's best lr (3e-2, the top of its grid) in the middle.
LRS_RECURRENT = (1e-2, 3e-2, 1e-1)
#: Lightning's gradient clipping, as RNN users set it.
CLIP = 1.0

SENSITIVE_ROWS = (
    ("lstm", ByteLSTM, cross_entropy, lambda: stdlib(8192), 32, 200, LRS_RECURRENT, ADAM, None),
    ("rnn_clipped", ByteRNN, cross_entropy, lambda: english(8192), 32, 200, LRS_HIGH, ADAM, None),
    ("cnn_long", DigitsCNN, cross_entropy, digits, 64, 450, LRS_MID, ADAM, None),
    ("lenet", LeNet, cross_entropy, digits, 64, 400, LRS_MID, ADAM, None),
    ("mlp_digits", lambda: relu_mlp(64, 10, 256, 2), cross_entropy, digits, 64, 400, LRS_MID, ADAM, None),
    ("tabular_classifier", lambda: relu_mlp(30, 2, 64, 2), cross_entropy, breast_cancer, 32, 300, LRS_MID, ADAM, None),
)
SENSITIVE_DESCRIPTIONS = {
    "lstm": "two-layer byte-level LSTM on stdlib source, on a hot lr grid (1e-2 to 1e-1)",
    "rnn_clipped": "Elman tanh RNN, byte-level on English text, with Lightning's gradient_clip_val=1.0",
    "cnn_long": "the digits CNN at 3x its steps (450): near-perfect accuracy, val loss from a few confident errors",
    "lenet": "LeNet-style CNN without normalisation on the digits, 400 steps (val cross-entropy and accuracy)",
    "mlp_digits": "three-layer ReLU MLP on the flattened digits, 400 steps (val cross-entropy and accuracy)",
    "tabular_classifier": "MLP on scikit-learn's breast-cancer data, 455 training rows (val cross-entropy, accuracy)",
}
#: Families that record their validation accuracy beside the loss.
CLASSIFIERS = ("cnn_long", "lenet", "mlp_digits", "tabular_classifier")
SENSITIVE: dict[str, Family] = {
    row[0]: Family(
        row[0],
        SENSITIVE_DESCRIPTIONS[row[0]],
        *row[1:],
        gradient_clip_val=CLIP if row[0] == "rnn_clipped" else None,
        metric=accuracy if row[0] in CLASSIFIERS else None,
    )
    for row in SENSITIVE_ROWS
}

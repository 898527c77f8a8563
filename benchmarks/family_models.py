"""The model families of ``families.py``: unchanged LightningModules that ask for AdamW.

Each family is a real :class:`lightning.pytorch.LightningModule` whose
``configure_optimizers`` returns ``torch.optim.AdamW`` with a linear warm-up and cosine
decay (:func:`lightning_dash.showcase.lightning_gpt.warmup_cosine`), as user code does, and
its data, built from what is on the machine: the Python standard library's source, the
English text of Python's own help topics (``pydoc_data.topics``), and the data sets that
ship inside scikit-learn (handwritten digits, diabetes) or that it generates (Friedman #1).
Nothing is downloaded.

A family gives the model's weights from ``seed`` and the order of its training batches from
``seed`` too, so AdamW and DASH on one seed start from the same weights and see the same
batches. Validation sets are fixed per family. Sizes are picked for 2 CPU cores.
"""

from __future__ import annotations

import functools
import math
import re
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from numpy.typing import ArrayLike
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_dash.showcase import TinyGPT
from lightning_dash.showcase.lightning_gpt import warmup_cosine
from lightning_dash.showcase.stdlib_text import load_stdlib_corpus

Batch = tuple[Tensor, ...]


# ---------------------------------------------------------------------- data
class SeededBatches(Dataset):
    """``steps`` batches of ``batch_size`` rows of ``tensors``, drawn by seeded permutations
    (epoch after epoch), one batch per item: a loader with ``batch_size=None`` yields them."""

    def __init__(self, tensors: tuple[Tensor, ...], batch_size: int, steps: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        rows = tensors[0].shape[0]
        epochs = math.ceil(steps * batch_size / rows)
        order = torch.cat([torch.randperm(rows, generator=generator) for _ in range(epochs)])
        self.index = order[: steps * batch_size].view(steps, batch_size)
        self.tensors = tensors

    def __len__(self) -> int:
        return self.index.shape[0]

    def __getitem__(self, step: int) -> Batch:
        rows = self.index[step]
        return tuple(tensor[rows] for tensor in self.tensors)


def windows(data: Tensor, context: int, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` random windows of a byte tensor (inputs) and their next bytes (targets)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (count,), generator=generator)
    rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


@functools.cache
def english_bytes() -> tuple[Tensor, Tensor]:
    """Python's help topics (English prose about the language), split 90/10 by topic."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = "\n".join(topics[n] for i, n in enumerate(names) if i % 10).encode("ascii", "replace")
    validation = "\n".join(topics[n] for i, n in enumerate(names) if i % 10 == 0).encode("ascii", "replace")
    as_tensor = lambda text: torch.frombuffer(bytearray(text), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(validation)


@functools.cache
def stdlib_bytes() -> tuple[Tensor, Tensor]:
    corpus = load_stdlib_corpus(max_bytes=2_000_000)
    return corpus.train, corpus.validation


# ---------------------------------------------------------------------- the module every family shares
class FamilyModule(pl.LightningModule):
    """A model, its loss and AdamW with warm-up + cosine: what ``strategy="dash"`` converts."""

    def __init__(self, net: nn.Module, loss: Callable[[nn.Module, Batch], Tensor], lr: float, betas: tuple) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss
        self.lr = lr
        self.betas = betas

    def loss(self, batch: Batch) -> Tensor:
        return self.loss_fn(self.net, batch)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self):  # noqa: ANN201 (Lightning's own union of return types)
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=self.betas, weight_decay=0.01)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, round(0.05 * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def cross_entropy(net: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    logits = net(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mean_squared_error(net: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(net(inputs), targets)


# ---------------------------------------------------------------------- the networks
class DigitsCNN(nn.Module):
    """Three 3x3 convolutions with batch norm, global pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(64, 10)

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images).flatten(1))


class ByteGRU(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 192) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.gru = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


class ResidualMLP(nn.Module):
    """Pre-norm residual blocks of two linear layers, as tabular models are written."""

    def __init__(self, features: int, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 1))

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.stem(x)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.out(hidden)


class BagOfWords(nn.Module):
    """A large hashed vocabulary averaged by ``EmbeddingBag``, then a small classifier."""

    def __init__(self, vocab: int, classes: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, width, mode="mean", padding_idx=0)
        self.classifier = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.classifier(self.embed(tokens))


class MixtureOfExperts(nn.Module):
    """Top-2 gated feed-forward experts whose weights are 3-D ``(experts, out, in)`` parameters."""

    def __init__(self, width: int, experts: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(width))
        self.w_out = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(hidden))

    def forward(self, x: Tensor) -> Tensor:
        scores = self.router(x)
        top, chosen = scores.topk(2, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, chosen, top.softmax(-1))
        hidden = nn.functional.gelu(torch.einsum("btw,ehw->bteh", x, self.w_in))
        return torch.einsum("bteh,ewh,bte->btw", hidden, self.w_out, gates)


class MoEBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.moe = MixtureOfExperts(width)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class ByteMoE(nn.Module):
    def __init__(self, context: int = 64, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(MoEBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        for block in self.blocks:
            x = block(x, self.mask[:length, :length])
        return self.head(self.norm(x))


class HuggingFaceLM(nn.Module):
    """A ``transformers`` causal LM built from a config (no weights downloaded); returns logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits


def tiny_gpt2(context: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=context, n_embd=64, n_layer=2, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return HuggingFaceLM(GPT2LMHeadModel(config))


# ---------------------------------------------------------------------- data sets
@functools.cache
def digits() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:1400], order[1400:]
    return (x[train], y[train]), (x[val], y[val])


def tabular_split(
    features: ArrayLike, target: ArrayLike, train_rows: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Rows shuffled with a fixed seed, the first ``train_rows`` for training; features and target
    standardised with the training rows' statistics."""
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(target, dtype=torch.float32).view(-1, 1)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:train_rows], order[train_rows:]
    mean, std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()
    scale = lambda rows: ((x[rows] - mean) / std, (y[rows] - y_mean) / y_std)  # noqa: E731
    return scale(train), scale(val)


@functools.cache
def diabetes() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    from sklearn.datasets import load_diabetes

    return tabular_split(*load_diabetes(return_X_y=True), train_rows=350)


@functools.cache
def friedman() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Friedman's first regression problem as scikit-learn generates it: 10 features, of which 5 are
    noise, and a noise of 1 on the target; 3,500 training rows (ten times the diabetes data's)."""
    from sklearn.datasets import make_friedman1

    return tabular_split(*make_friedman1(n_samples=4500, n_features=10, noise=1.0, random_state=0), train_rows=3500)


#: Top-level packages of the standard library whose source the bag-of-words model tells apart.
BOW_PACKAGES = (
    "asyncio",
    "email",
    "json",
    "xml",
    "http",
    "multiprocessing",
    "concurrent",
    "ctypes",
    "unittest",
    "importlib",
    "logging",
    "urllib",
    "tkinter",
    "sqlite3",
    "curses",
    "dbm",
)


def hashed_words(text: str, vocab: int, length: int) -> Tensor:
    """The first ``length`` identifiers of ``text`` hashed (crc32, stable across runs) into
    ``1..vocab-1``, padded with 0."""
    ids = [1 + zlib.crc32(word.encode()) % (vocab - 1) for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)]
    ids = ids[:length] + [0] * max(0, length - len(ids))
    return torch.tensor(ids)


@functools.cache
def stdlib_chunks(vocab: int, lines: int = 12, length: int = 48) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Chunks of ``lines`` source lines labelled with their package; every 5th file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    splits: tuple[list, list] = ([], [])
    for label, package in enumerate(BOW_PACKAGES):
        for index, path in enumerate(sorted((root / package).rglob("*.py"))):
            if "test" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            for start in range(0, len(text), lines):
                words = hashed_words("\n".join(text[start : start + lines]), vocab, length)
                if int((words > 0).sum()) >= 8:
                    splits[index % 5 == 0].append((words, label))
    stack = lambda rows: (torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))  # noqa: E731
    return stack(splits[0]), stack(splits[1])


# ---------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Family:
    """A model family: its network, loss, data and AdamW recipe (``betas``, an lr grid)."""

    name: str
    description: str
    make_net: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Batch], Tensor]
    data: Callable[[], tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]
    batch_size: int
    steps: int
    adamw_lrs: tuple[float, ...]
    betas: tuple[float, float] = (0.9, 0.999)
    starting_point: Callable[[nn.Module], None] | None = None
    #: Lightning's ``gradient_clip_val`` for both contenders (None: no clipping)
    gradient_clip_val: float | None = None
    #: a second validation measure recorded beside the loss (for classifiers, accuracy), or None
    metric: Callable[[nn.Module, Batch], Tensor] | None = None

    def module(self, lr: float, seed: int) -> FamilyModule:
        """The LightningModule with weights from ``seed`` (the global RNG is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = self.make_net()
        if self.starting_point is not None:
            self.starting_point(net)
        return FamilyModule(net, self.loss, lr, self.betas)

    def train_loader(self, seed: int, steps: int) -> DataLoader:
        """``steps`` batches in the order ``seed`` draws (one epoch: ``max_steps`` ends with it)."""
        train, _ = self.data()
        return DataLoader(SeededBatches(train, self.batch_size, steps, seed), batch_size=None)

    def validation_batches(self, batch_size: int = 256) -> list[Batch]:
        _, validation = self.data()
        rows = validation[0].shape[0]
        return [tuple(t[i : i + batch_size] for t in validation) for i in range(0, rows, batch_size)]


CONTEXT = 64


@functools.cache
def text_windows(source: str, train_count: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    train, validation = english_bytes() if source == "english" else stdlib_bytes()
    return windows(train, CONTEXT, train_count, seed=1), windows(validation, CONTEXT, 256, seed=12345)


@functools.cache
def pretrained_gpt_state(steps: int = 300, lr: float = 3e-3) -> dict[str, Tensor]:
    """TinyGPT trained on stdlib source with AdamW (plain loop, fixed seed): the checkpoint the
    fine-tuning family starts from. Computed once per process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000)
        net = TinyGPT(context=CONTEXT, width=64, depth=2, heads=4)
    (x, y), _ = text_windows("stdlib", 8192)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(15, steps))
    for batch in SeededBatches((x, y), 32, steps, seed=1000):
        loss = cross_entropy(net, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def load_pretrained(net: nn.Module) -> None:
    net.load_state_dict(pretrained_gpt_state())


def gpt() -> nn.Module:
    return TinyGPT(context=CONTEXT, width=64, depth=2, heads=4)


def bag_of_words() -> nn.Module:
    return BagOfWords(2048, len(BOW_PACKAGES))


#: AdamW's learning-rate grids, and its betas for the language models (Adam's defaults elsewhere).
LRS_LOW, LRS_MID, LRS_HIGH = (3e-4, 1e-3, 3e-3), (1e-3, 3e-3, 1e-2), (3e-3, 1e-2, 3e-2)
ADAM, LM = (0.9, 0.999), (0.9, 0.95)
english, stdlib = functools.partial(text_windows, "english"), functools.partial(text_windows, "stdlib")

#: One family a row: name, network, loss, data, batch size, steps, AdamW lr grid, betas, starting point.
ROWS = (
    ("cnn", DigitsCNN, cross_entropy, digits, 64, 150, LRS_MID, ADAM, None),
    ("gru", ByteGRU, cross_entropy, lambda: english(8192), 32, 200, LRS_HIGH, ADAM, None),
    ("gpt", gpt, cross_entropy, lambda: stdlib(8192), 32, 200, LRS_MID, LM, None),
    ("finetune", gpt, cross_entropy, lambda: english(4096), 32, 100, LRS_LOW, LM, load_pretrained),
    ("mlp", lambda: ResidualMLP(10), mean_squared_error, diabetes, 32, 150, LRS_LOW, ADAM, None),
    ("mlp_friedman", lambda: ResidualMLP(10), mean_squared_error, friedman, 32, 150, LRS_LOW, ADAM, None),
    ("embedding", bag_of_words, cross_entropy, lambda: stdlib_chunks(2048), 64, 150, LRS_HIGH, ADAM, None),
    ("moe", ByteMoE, cross_entropy, lambda: stdlib(8192), 32, 150, LRS_MID, LM, None),
    ("hf_gpt2", lambda: tiny_gpt2(CONTEXT), cross_entropy, lambda: english(8192), 32, 150, LRS_MID, LM, None),
)
DESCRIPTIONS = {
    "cnn": "CNN with batch norm on scikit-learn's 8x8 digits (val cross-entropy)",
    "gru": "byte-level GRU on English text (Python's help topics)",
    "gpt": "byte-level GPT pretraining on stdlib source (the demo's model, width 64)",
    "finetune": "the GPT pretrained on stdlib source, fine-tuned on English text",
    "mlp": "residual LayerNorm MLP, tabular regression on scikit-learn's diabetes data (val MSE)",
    "mlp_friedman": "the same MLP on ten times the rows: scikit-learn's Friedman #1 regression (val MSE)",
    "embedding": "EmbeddingBag over 2048 hashed identifiers: which stdlib package a code chunk is from",
    "moe": "byte-level transformer with top-2 mixture-of-experts layers (3-D expert weights)",
    "hf_gpt2": "Hugging Face transformers GPT-2 from a tiny config (tied embeddings), English text",
}
FAMILIES: dict[str, Family] = {row[0]: Family(row[0], DESCRIPTIONS[row[0]], *row[1:]) for row in ROWS}

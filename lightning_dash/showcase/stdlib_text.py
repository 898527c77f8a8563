"""Byte-level language-modelling data from the Python standard library's own source.

Every machine with Python has tens of megabytes of real code under
``sysconfig.get_paths()["stdlib"]``; no download is needed. Files are split into
training and validation sets by file (a held-out set of whole files), in a
deterministic order.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset


@dataclass(frozen=True)
class ByteCorpus:
    """Training and validation bytes as uint8 tensors."""

    train: Tensor
    validation: Tensor

    def batch(self, split: str, batch_size: int, context: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random windows of ``context`` bytes and their next-byte targets."""
        data = self.train if split == "train" else self.validation
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, excluding tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idlelib", "lib2to3"}:
            continue
        files.append(path)
    return files


def load_stdlib_corpus(max_bytes: int = 4_000_000, validation_every: int = 10) -> ByteCorpus:
    """Read up to ``max_bytes`` of stdlib source; every ``validation_every``-th file is held out."""
    train: list[bytes] = []
    validation: list[bytes] = []
    total = 0
    for index, path in enumerate(stdlib_files()):
        content = path.read_bytes()
        (validation if index % validation_every == 0 else train).append(content)
        total += len(content)
        if total >= max_bytes:
            break
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return ByteCorpus(train=as_tensor(train), validation=as_tensor(validation))


class RandomWindows(Dataset):
    """``count`` windows of ``context`` bytes (inputs) and their next bytes (targets),
    at offsets drawn once from a generator seeded with ``seed``: fixed and reproducible,
    so runs with different optimizers or trainers see the same batches."""

    def __init__(self, data: Tensor, context: int, count: int, seed: int) -> None:
        if data.numel() <= context + 1:
            raise ValueError(f"{data.numel()} bytes are too few for windows of {context}")
        generator = torch.Generator().manual_seed(seed)
        self.data = data
        self.context = context
        self.starts = torch.randint(0, data.numel() - context - 1, (count,), generator=generator)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        window = self.data[start : start + self.context + 1].long()
        return window[:-1], window[1:]

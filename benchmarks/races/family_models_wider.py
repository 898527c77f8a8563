"""Five more families for ``families.py``, chosen before any DASH run on them: a model kind the
first nine lack each, or a longer or hotter run of one they have.

- ``seq2seq``: an encoder-decoder transformer (``nn.Transformer``) that restores English text
  whose bytes were corrupted (15% replaced at random), by teacher forcing.
- ``unet``: a convolutional U-Net (one skip connection) that denoises scikit-learn's 8x8
  digits (a reconstruction loss, mean squared error against the clean image).
- ``bert``: a BERT-style encoder built by Hugging Face ``transformers`` from a config
  (``BertForSequenceClassification``), trained to tell which standard-library package a chunk of
  source comes from (the bag-of-words family's data, as token sequences with padding masked).
- ``gpt_long``: the GPT pretraining family at three times its steps (600).
- ``gru_long``: the byte-level GRU at 300 steps on an lr grid one step hotter than the GRU
  family's (AdamW's best lr there was the top of its grid).

Same protocol as the rest: AdamW with warm-up + cosine, its lr tuned per family on the grid.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from family_models import (
    ADAM,
    BOW_PACKAGES,
    LM,
    LRS_MID,
    Batch,
    ByteGRU,
    Family,
    cross_entropy,
    digits,
    english,
    gpt,
    mean_squared_error,
    stdlib,
    stdlib_chunks,
)

SEQ2SEQ_LENGTH = 32
CORRUPTED = 0.15


class ByteDenoiser(nn.Module):
    """Byte embeddings with learned positions, ``nn.Transformer`` (2 + 2 layers), a byte head.
    Input: the corrupted text and the clean text shifted right (0 starts it); output: logits."""

    def __init__(self, width: int = 64, heads: int = 4, length: int = SEQ2SEQ_LENGTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        self.transformer = nn.Transformer(
            width, heads, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=2 * width, dropout=0.0,
            batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, corrupted: Tensor, shifted: Tensor) -> Tensor:
        length = shifted.shape[1]
        source = self.embed(corrupted) + self.position[: corrupted.shape[1]]
        target = self.embed(shifted) + self.position[:length]
        return self.head(self.transformer(source, target, tgt_mask=self.mask[:length, :length]))


def denoising_cross_entropy(net: nn.Module, batch: Batch) -> Tensor:
    corrupted, clean = batch
    shifted = torch.cat([torch.zeros_like(clean[:, :1]), clean[:, :-1]], dim=1)
    logits = net(corrupted, shifted)
    return nn.functional.cross_entropy(logits.reshape(-1, 256), clean.reshape(-1))


def corrupt(clean: Tensor, seed: int) -> Tensor:
    """``clean`` with each byte replaced by a random one with probability ``CORRUPTED``."""
    generator = torch.Generator().manual_seed(seed)
    hit = torch.rand(clean.shape, generator=generator) < CORRUPTED
    return torch.where(hit, torch.randint(0, 256, clean.shape, generator=generator), clean)


@functools.cache
def corrupted_english() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    (train, _), (validation, _) = english(8192)
    train, validation = train[:, :SEQ2SEQ_LENGTH], validation[:, :SEQ2SEQ_LENGTH]
    return (corrupt(train, 1), train), (corrupt(validation, 2), validation)


class DigitsUNet(nn.Module):
    """Two 3x3 convolutions at 8x8, one stride-2 level at 4x4, a transposed convolution back up
    and the skip connection concatenated, then a 1x1 convolution to one channel."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
        )
        self.up = nn.ConvTranspose2d(2 * channels, channels, 2, stride=2)
        self.decode = nn.Sequential(nn.Conv2d(2 * channels, channels, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(channels, 1, 1)

    def forward(self, images: Tensor) -> Tensor:
        skip = self.encode(images)
        joined = torch.cat([skip, self.up(self.down(skip))], dim=1)
        return self.out(self.decode(joined))


@functools.cache
def noisy_digits() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Digits with Gaussian noise (standard deviation 0.3, pixels in [0, 1]) and the clean image."""
    (train, _), (validation, _) = digits()
    generator = torch.Generator().manual_seed(3)
    noisy = lambda clean: clean + 0.3 * torch.randn(clean.shape, generator=generator)  # noqa: E731
    return (noisy(train), train), (noisy(validation), validation)


class HuggingFaceClassifier(nn.Module):
    """A ``transformers`` sequence classifier built from a config; padding (id 0) is masked."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens, attention_mask=(tokens != 0).long()).logits


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=len(BOW_PACKAGES),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return HuggingFaceClassifier(BertForSequenceClassification(config))


#: The grid of the hotter GRU run: the GRU family's top lr in the middle.
LRS_HOTTER = (1e-2, 3e-2, 1e-1)

WIDER_ROWS = (
    ("seq2seq", ByteDenoiser, denoising_cross_entropy, corrupted_english, 32, 200, LRS_MID, LM, None),
    ("unet", DigitsUNet, mean_squared_error, noisy_digits, 64, 150, LRS_MID, ADAM, None),
    ("bert", tiny_bert, cross_entropy, lambda: stdlib_chunks(2048), 64, 150, LRS_MID, ADAM, None),
    ("gpt_long", gpt, cross_entropy, lambda: stdlib(8192), 32, 600, LRS_MID, LM, None),
    ("gru_long", ByteGRU, cross_entropy, lambda: english(8192), 32, 300, LRS_HOTTER, ADAM, None),
)
WIDER_DESCRIPTIONS = {
    "seq2seq": f"encoder-decoder transformer restoring English text with {CORRUPTED:.0%} of its bytes corrupted",
    "unet": "convolutional U-Net denoising scikit-learn's 8x8 digits (val MSE against the clean image)",
    "bert": "Hugging Face BERT encoder from a config, classifying which stdlib package a source chunk is from",
    "gpt_long": "the GPT pretraining family at 3x its steps (600)",
    "gru_long": "the byte-level GRU on English text at 300 steps, on a hotter lr grid",
}
WIDER: dict[str, Family] = {row[0]: Family(row[0], WIDER_DESCRIPTIONS[row[0]], *row[1:]) for row in WIDER_ROWS}

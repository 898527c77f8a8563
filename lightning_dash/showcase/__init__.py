"""The showcase: what the main job and the examples train on, dependency-free (real text, a tiny GPT)."""

from lightning_dash.showcase.stdlib_text import ByteCorpus, load_stdlib_corpus
from lightning_dash.showcase.tiny_gpt import TinyGPT

__all__ = ["ByteCorpus", "TinyGPT", "load_stdlib_corpus"]

"""Small, dependency-free pieces for demos and benchmarks: real text and a tiny GPT."""

from lightning_dash.demos.stdlib_text import ByteCorpus, load_stdlib_corpus
from lightning_dash.demos.tiny_gpt import TinyGPT

__all__ = ["ByteCorpus", "TinyGPT", "load_stdlib_corpus"]

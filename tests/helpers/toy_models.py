"""Small models the routing and step tests share: a toy mixture of experts and GPT-2 parameter shapes."""

from __future__ import annotations

import torch
from torch import nn


class ToyMoE(nn.Module):
    """Embedding, fused QKV attention, a dense mixture of experts stored as 3-D
    parameters ``(experts, out, in)``, and an output layer."""

    def __init__(self, vocab: int = 11, width: int = 6, hidden: int = 10, experts: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.router = nn.Linear(width, experts)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, width) / width**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, width, hidden) / hidden**0.5)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        gate = torch.softmax(self.router(x), dim=-1)  # (batch, time, experts)
        hidden = torch.relu(torch.einsum("btw,ehw->bteh", x, self.w_in))
        x = x + torch.einsum("bte,bteh,ewh->btw", gate, hidden, self.w_out)
        return self.head(self.norm(x))


def toy_loss(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (4, 5), generator=generator)
    targets = torch.randint(0, 11, (4, 5), generator=generator)
    return nn.functional.cross_entropy(model(tokens).reshape(-1, 11), targets.reshape(-1))


WIDTH = 64


def gpt_params(layers: int) -> list[tuple[str, torch.nn.Parameter]]:
    """GPT-2-style parameter shapes (fused QKV, 4x MLP, LayerNorms, biases) of width 64."""
    w = WIDTH
    shapes = [("wte", (256, w)), ("wpe", (64, w))]
    for layer in range(layers):
        for name, shape in [
            ("ln_1.weight", (w,)),
            ("ln_1.bias", (w,)),
            ("attn.c_attn.weight", (3 * w, w)),
            ("attn.c_attn.bias", (3 * w,)),
            ("attn.c_proj.weight", (w, w)),
            ("attn.c_proj.bias", (w,)),
            ("ln_2.weight", (w,)),
            ("ln_2.bias", (w,)),
            ("mlp.c_fc.weight", (4 * w, w)),
            ("mlp.c_fc.bias", (4 * w,)),
            ("mlp.c_proj.weight", (w, 4 * w)),
            ("mlp.c_proj.bias", (w,)),
        ]:
            shapes.append((f"h.{layer}.{name}", shape))
    generator = torch.Generator().manual_seed(0)
    return [(name, torch.nn.Parameter(0.02 * torch.randn(shape, generator=generator))) for name, shape in shapes]

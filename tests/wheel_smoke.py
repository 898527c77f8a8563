"""Run by ``make package`` with the installed wheel, outside the source tree: the package
imports with torch alone, without the distributed machinery it does not need
(``torch.distributed.tensor``, imported only when FSDP2 is used), and DASH takes steps that
lower a least-squares loss."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import lightning_dash
from lightning_dash import DASH

source_tree = Path(__file__).resolve().parent.parent / "lightning_dash"
if Path(lightning_dash.__file__).resolve().parent == source_tree:
    sys.exit(f"imported the source tree ({lightning_dash.__file__}), not the installed wheel")
if importlib.util.find_spec("lightning") is not None:
    sys.exit("the wheel's environment should hold torch alone, but lightning is installed")
if "torch.distributed.tensor" in sys.modules:
    sys.exit("from lightning_dash import DASH imported torch.distributed.tensor; only FSDP2 code needs it")

torch.manual_seed(0)
inputs, weights = torch.randn(64, 8), torch.randn(8, 3)
targets = inputs @ weights
model = torch.nn.Linear(8, 3)
optimizer = DASH(model.parameters(), lr=0.05)
losses = []
for _ in range(30):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
if not losses[-1] < 0.1 * losses[0]:
    sys.exit(f"DASH from the wheel did not train: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
installed = Path(lightning_dash.__file__).parent
print(f"wheel {lightning_dash.__version__} from {installed}: loss {losses[0]:.3f} -> {losses[-1]:.4f}")

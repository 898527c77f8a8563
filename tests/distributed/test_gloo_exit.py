"""The strategies pause at interpreter exit so gloo's workers finish before Python finalises.

Without the pause, two-process gloo runs aborted with SIGABRT after succeeding (see
:mod:`lightning_dash.distributed.gloo_exit`). Each case runs in a fresh interpreter: an
``atexit`` observer registered first runs last, so the time between the script's last
statement and the observer is at least the pause when (and only when) it was registered.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lightning_dash.distributed.gloo_exit import SETTLE_SECONDS

PRELUDE = """
import atexit, time
atexit.register(lambda: print("exit", time.monotonic()))  # registered first: runs last
"""

TRAINER = """
import lightning_dash, torch
import lightning.pytorch as pl

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(1, 2))

settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
pl.Trainer(accelerator="cpu", devices=1, strategy="{name}", max_steps=1, **settings).fit(Tiny())
"""

#: Set-ups that start a gloo process group, each with the pause registered.
SET_UPS = {
    "gloo group": """
        import tempfile
        import torch.distributed as dist
        from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        settle_gloo_workers_at_exit()
        settle_gloo_workers_at_exit()  # registered once
    """,
    "Fabric dash": """
        import lightning_dash
        from lightning.fabric import Fabric
        Fabric(accelerator="cpu", devices=1, strategy="dash").launch()
    """,
    "Fabric dash_fsdp": """
        import lightning_dash
        from lightning.fabric import Fabric
        Fabric(accelerator="cpu", devices=1, strategy="dash_fsdp").launch()
    """,
    # FSDP2 needs a device mesh, so "dash_fsdp" starts a group even on one device
    "Trainer dash_fsdp": TRAINER.replace("{name}", "dash_fsdp"),
}


def exit_pause(set_up: str) -> float:
    """Seconds between the end of ``set_up`` and the last ``atexit`` handler, in a fresh interpreter."""
    script = PRELUDE + textwrap.dedent(set_up) + '\nprint("end", time.monotonic())\n'
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    times = dict(line.split() for line in result.stdout.splitlines() if line.startswith(("end ", "exit ")))
    return float(times["exit"]) - float(times["end"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("set_up", sorted(SET_UPS))
def test_a_gloo_process_group_set_up_by_us_pauses_the_exit(set_up):
    assert exit_pause(SET_UPS[set_up]) >= SETTLE_SECONDS


@pytest.mark.multiprocess
def test_one_device_under_strategy_dash_starts_no_group_and_so_does_not_pause():
    assert exit_pause(TRAINER.replace("{name}", "dash")) < SETTLE_SECONDS

"""``Dash`` under Composer's own launcher: two processes, gloo on CPU.

Each run is ``python -m composer.cli.launcher -n 2 composer_runs.py ...``; every rank
saves its final parameters and DASH's sharding facts, which the tests compare across
ranks, against single-process DASH on the same global batches, and across a
save/autoresume.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer_runs import (
    BASE_LR,
    DASH_OPTIONS,
    TOTAL_BATCHES,
    assert_tracks_reference,
    build_model,
    make_trainer,
    named_parameters,
    reference_parameters,
    schedule_factor,
)

from lightning_dash.distributed import block_shapes

SCRIPT = Path(__file__).with_name("composer_runs.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path: Path, name: str, *args: str, n: int = 2) -> list[dict]:
    """Run the training script on ``n`` ranks; return what each rank saved."""
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    # The ranks import this checkout's lightning_dash (SCRIPT.parents[2]), as the tests do.
    paths = [str(SCRIPT.parent), str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    command = [
        sys.executable,
        "-m",
        "composer.cli.launcher",
        "-n",
        str(n),
        "--master_port",
        str(free_port()),
        "--stderr",
        str(out / "stderr{rank}.txt"),
        str(SCRIPT),
        "--out",
        str(out),
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        logs = "".join(path.read_text() for path in sorted(out.glob("stderr*.txt")))
        pytest.fail(
            f"launcher failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{logs[-3000:]}"
        )
    return [torch.load(out / f"rank{rank}.pt") for rank in range(n)]


def assert_same_on_both_ranks(ranks: list[dict]) -> None:
    assert ranks[0]["parameters"].keys() == ranks[1]["parameters"].keys()
    for name, value in ranks[0]["parameters"].items():
        assert torch.equal(value, ranks[1]["parameters"][name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt", "classifier"])
def test_two_ranks_share_blocks_and_match_one_process(tmp_path: Path, kind: str) -> None:
    ranks = launch(
        tmp_path,
        "run",
        "--kind",
        kind,
        "--max-duration",
        f"{TOTAL_BATCHES}ba",
        "--save-folder",
        str(tmp_path / "checkpoints"),
    )
    for rank in ranks:
        assert rank["optimizer"] == "DASH"
        assert rank["world_size"] == 2
        assert rank["batches"] == TOTAL_BATCHES
        assert rank["lrs"] == pytest.approx([BASE_LR * schedule_factor(b) for b in range(TOTAL_BATCHES)])
        assert 1.0 <= rank["ownership_balance"] < 1.5
    # Both ranks assign every block of the model to the same owner; each owns a share, together all of them.
    shapes = [tuple(p.shape) for p in build_model(kind).parameters()]
    total_blocks = len(block_shapes(shapes, DASH_OPTIONS["block_size"]))
    assert ranks[0]["owners"] == ranks[1]["owners"] and len(ranks[0]["owners"]) == total_blocks
    assert 0 < ranks[0]["owned_blocks"] < total_blocks
    assert ranks[0]["owned_blocks"] + ranks[1]["owned_blocks"] == total_blocks
    assert_same_on_both_ranks(ranks)
    # DDP averages the two half-batches: the same gradient as one process on the whole batch.
    assert_tracks_reference(ranks[0]["parameters"], reference_parameters(kind, TOTAL_BATCHES), kind)


@pytest.mark.multiprocess
def test_two_rank_autoresume_continues_exactly(tmp_path: Path) -> None:
    uninterrupted = launch(
        tmp_path,
        "full",
        "--kind",
        "gpt",
        "--max-duration",
        f"{TOTAL_BATCHES}ba",
        "--save-folder",
        str(tmp_path / "full_checkpoints"),
    )
    folder = str(tmp_path / "checkpoints")
    launch(
        tmp_path,
        "first",
        "--kind",
        "gpt",
        "--max-duration",
        "3ba",
        "--save-folder",
        folder,
        "--run-name",
        "auto",
        "--autoresume",
    )
    resumed = launch(
        tmp_path,
        "second",
        "--kind",
        "gpt",
        "--max-duration",
        f"{TOTAL_BATCHES}ba",
        "--save-folder",
        folder,
        "--run-name",
        "auto",
        "--autoresume",
    )
    # The second launch only ran the batches after the checkpoint of the first.
    assert len(resumed[0]["lrs"]) == TOTAL_BATCHES - 3
    assert_same_on_both_ranks(resumed)
    for name, value in resumed[0]["parameters"].items():
        assert torch.equal(value, uninterrupted[0]["parameters"][name]), name


@pytest.mark.multiprocess
def test_a_two_rank_checkpoint_resumes_in_one_process(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    launch(tmp_path, "first", "--kind", "gpt", "--max-duration", "4ba", "--save-folder", str(folder))
    resumed = make_trainer("gpt", f"{TOTAL_BATCHES}ba", load_path=str(folder / "ep0-ba4-rank0.pt"))
    assert resumed.state.timestamp.batch.value == 4
    resumed.fit()
    # Up to the float rounding of averaging over two ranks, the same as one process throughout.
    assert_tracks_reference(named_parameters(resumed.state.model), reference_parameters("gpt", TOTAL_BATCHES), "gpt")
    resumed.close()

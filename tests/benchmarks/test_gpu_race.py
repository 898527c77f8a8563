"""The GPU race (benchmarks/races/gpu_race.py) on the CPU at a tiny size, so that its one GPU run is right.

The records, the target (AdamW's best final loss) and every run's steps and seconds to it, recomputed
here from the records' curves; then the robustness the GPU run relies on: a run whose optimizer fails is
recorded as an error and the others go on, and the per-run wall budget stops a run and keeps its curve.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_dash import DashConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "races"))

import gpu_race

TINY = [
    "--device",
    "cpu",
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "20",
    "--eval-every",
    "10",
    "--val-windows",
    "16",
    "--max-bytes",
    "200000",
    "--adamw-lrs",
    "3e-3,1e-2",
]
FIELDS = {
    "device",
    "model",
    "params",
    "optimizer",
    "lr",
    "options",
    "status",
    "note",
    "train_step_ms",
    "optimizer_step_ms",
    "train_step_mean_ms",
    "optimizer_step_mean_ms",
    "roofline_ms",
    "state_bytes",
    "state_bytes_per_param",
    "peak_memory_bytes",
    "final_loss",
    "steps_to_adamw_final",
    "seconds_to_adamw_final",
    "adamw_seconds",
    "time_ratio",
    "curve",
    "steps",
    "batch_size",
    "context",
    "autocast",
    "date",
    "commit",
    "torch",
}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on this project's shared 2-core machine two threads beside a busy process ran the
    tiny race 10x slower (see peers.py's docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def first_at_or_below(curve: list[list], target: float) -> list | None:
    return next((point for point in curve if point[0] > 0 and point[2] is not None and point[2] <= target), None)


def test_tiny_race_records_and_scores(tmp_path):
    returned = gpu_race.main([*TINY, "--out", str(tmp_path), "--optimizers", "adamw,dash,muon"])
    records = json.loads((tmp_path / "gpu_cpu.json").read_text())
    assert records == returned
    assert [(r["optimizer"], r["lr"]) for r in records] == [
        ("adamw", 3e-3),
        ("adamw", 1e-2),
        ("dash", 1e-2),
        ("muon", gpu_race.MUON_LR),
    ]
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["status"] == "ok" and r["device"] == "cpu" and r["model"] == "tinygpt-w32-d1-c32"
        assert [point[0] for point in r["curve"]] == [0, 10, 20]
        assert r["final_loss"] == r["curve"][-1][2] < r["curve"][0][2]  # trained, and its last evaluation
        assert r["peak_memory_bytes"] is None and r["roofline_ms"] is None and r["autocast"] is False
        assert 0 < r["optimizer_step_ms"] < r["train_step_ms"]
    adamw = [r for r in records if r["optimizer"] == "adamw"]
    best = min(adamw, key=lambda r: r["curve"][-1][2])
    target = best["curve"][-1][2]
    for r in records:
        reached = first_at_or_below(r["curve"], target)
        assert r["steps_to_adamw_final"] == (reached[0] if reached else None), r["optimizer"]
        assert r["seconds_to_adamw_final"] == (reached[1] if reached else None), r["optimizer"]
        assert r["adamw_seconds"] == best["curve"][-1][1]
        if reached:
            assert math.isclose(r["time_ratio"], reached[1] / best["curve"][-1][1])
    assert best["steps_to_adamw_final"] == 20 and best["time_ratio"] == 1.0
    # DASH from AdamW's recipe: AdamW's best lr, DASH's defaults, as the optimizer resolved them.
    dash = next(r for r in records if r["optimizer"] == "dash")
    assert dash["lr"] == best["lr"] and dash["options"]["block_size"] == 1024
    assert dash["options"]["lr_scale"] == DashConfig().lr_scale and dash["options"]["precondition_frequency"] >= 1
    muon = next(r for r in records if r["optimizer"] == "muon")
    assert muon["options"]["adamw_lr"] == best["lr"]
    # AdamW keeps two float32 moments per parameter (and a step counter per tensor).
    for r in adamw:
        assert 0 <= r["state_bytes"] - 8 * r["params"] <= 8 * 16
        assert 8 <= r["state_bytes_per_param"] < 8.01


def test_a_failing_contender_is_recorded_and_the_budget_stops_runs(tmp_path, monkeypatch, capsys):
    class Broken(gpu_race.DASH):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("no DASH today")

    monkeypatch.setattr(gpu_race, "DASH", Broken)
    flags = ["--optimizers", "adamw,dash,dash_lr_scale,meta_shampoo", "--dash-lr-scales", "2,4", "--run-budget-s", "0"]
    records = gpu_race.main([*TINY, "--out", str(tmp_path), *flags])
    assert [r["optimizer"] for r in records] == [
        "adamw",
        "adamw",
        "dash",
        "dash_lr_scale",
        "dash_lr_scale",
        "meta_shampoo",
    ]
    for r in records[:2]:  # stopped after their first step, evaluated there
        assert r["status"] == "budget" and [point[0] for point in r["curve"]] == [0, 1]
        assert r["final_loss"] == r["curve"][-1][2]
    for r in records[2:5]:
        assert r["status"] == "error" and "no DASH today" in r["note"] and r["final_loss"] is None
    assert [r["options"]["lr_scale"] for r in records[3:5]] == [2.0, 4.0]
    meta = records[5]
    if importlib.util.find_spec("distributed_shampoo") is None:
        assert meta["status"] == "unavailable" and meta["curve"] == []
    else:
        assert meta["status"] == "budget" and meta["options"]["block_size"] == 1024
    assert "no DASH today" in capsys.readouterr().err  # the traceback, for the one GPU run's log

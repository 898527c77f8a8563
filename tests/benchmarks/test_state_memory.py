"""Checks of the optimizer-state benchmark (``benchmarks/memory/state_memory.py``); nothing is timed.

DASH's measured state must equal its closed form, recomputed here tile by tile from the
shapes (not with the script's own helper); AdamW's must be two float32 moments per element
and a float32 step count per tensor; one step must leave every contender all its state (the
script's default); views must count their storage once; and a run must write the documented
record layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "memory"))

import state_memory

BLOCK = 32
#: An embedding cut into three tiles at block 32 (32, 32 and 6 rows of 30), a hidden matrix into
#: two (32 and 8 rows of 24), and a vector.
SHAPES = [("wte", (70, 30)), ("h.0.mlp.c_fc.weight", (40, 24)), ("h.0.mlp.c_fc.bias", (40,))]
WTE_TILES = [(32, 30), (32, 30), (6, 30)]
HIDDEN_TILES = [(32, 24), (8, 24)]
FLOAT32 = 4
#: A float32 step count per parameter tensor.
STEPS_BYTES = FLOAT32 * len(SHAPES)
RECORD_KEYS = {
    "device",
    "model",
    "optimizer",
    "routing",
    "block_size",
    "params",
    "state_bytes",
    "state_bytes_per_param",
    "cuda_allocated_bytes",
    "note",
    "date",
    "commit",
}


def tile_bytes(rows: int, cols: int) -> int:
    """A DASH tile: left factor and root (two triangles of rows^2 with their diagonals: rows *
    (rows + 1)), right factor and root (cols * (cols + 1)), momentum and grafting second moment
    (rows * cols each), all float32; then root_valid (bool), root_failures (int32) and factor_scale
    (float64)."""
    return FLOAT32 * (rows * (rows + 1) + cols * (cols + 1) + 2 * rows * cols) + 1 + 4 + 8


def adam_bytes(numel: int) -> int:
    """Two float32 moments per element."""
    return 2 * FLOAT32 * numel


def test_dash_and_adamw_state_match_their_closed_forms():
    records = state_memory.run(SHAPES, "three-tensors", torch.device("cpu"), BLOCK, 3, ["adamw", "dash"])
    by_routing = {(r.optimizer, r.routing): r for r in records}
    matrices = sum(tile_bytes(*tile) for tile in WTE_TILES + HIDDEN_TILES)
    assert by_routing["dash", "all_matrices"].state_bytes == matrices + adam_bytes(40) + STEPS_BYTES
    hidden = sum(tile_bytes(*tile) for tile in HIDDEN_TILES)
    assert by_routing["dash", "hidden"].state_bytes == hidden + adam_bytes(70 * 30 + 40) + STEPS_BYTES
    assert "roots in use on 5 of 5 blocks" in by_routing["dash", "all_matrices"].note
    assert "roots in use on 2 of 2 blocks" in by_routing["dash", "hidden"].note
    params = 70 * 30 + 40 * 24 + 40
    adamw = by_routing["adamw", None]
    assert adamw.state_bytes == adam_bytes(params) + STEPS_BYTES
    assert adamw.params == params
    assert adamw.state_bytes_per_param == adamw.state_bytes / params
    assert adamw.cuda_allocated_bytes is None


def test_one_step_holds_all_the_state():
    """The script's default of one step: every contender's state is complete after it."""
    names = state_memory.OPTIMIZER_NAMES
    one, three = (state_memory.run(SHAPES, "three-tensors", torch.device("cpu"), BLOCK, s, names) for s in (1, 3))
    assert [r.state_bytes for r in one] == [r.state_bytes for r in three]


def test_views_count_their_storage_once_and_parameters_not_at_all():
    param = torch.zeros(10, 10)
    moment = torch.zeros(6, 4)
    state = {param: {"whole": moment, "views": [moment[0], (moment[1:3],)], "param": param, "step": 3}}
    assert state_memory.storage_bytes(state_memory.held_tensors(state), [param]) == FLOAT32 * 24


def test_a_run_writes_one_record_per_contender(tmp_path, capsys):
    records = state_memory.main(["--model", "gpt-tiny", "--device", "cpu", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "state_memory_cpu.json").read_text())
    assert [(r["optimizer"], r["routing"]) for r in written] == [
        (name, routing) for name, routing, _ in state_memory.CONTENDERS
    ]
    assert len(records) == len(written)
    for record in written:
        assert set(record) == RECORD_KEYS
        assert record["model"] == "gpt-tiny"
        # A contender that is not installed has a note saying so, and no bytes.
        assert record["state_bytes"] is not None or record["note"]
    assert "closed form" in capsys.readouterr().out

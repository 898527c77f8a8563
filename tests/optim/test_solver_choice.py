"""The solver ``inverse_root_method="auto"`` resolves to (:mod:`lightning_dash.optim.roots.choice`).

Always a known solver; the CPU table equal to the winners recorded by
``benchmarks/speed/solver_choice.py`` in ``benchmarks/speed/results/solver_choice_cpu.json`` (so the
table cannot drift from the measurement); block sizes mapped to the right bucket. Nothing
is timed here: the timings are the benchmark's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_dash.optim.roots import INVERSE_ROOT_METHODS
from lightning_dash.optim.roots.choice import (
    CPU_TABLE,
    CUDA_TABLE,
    FALLBACK_METHOD,
    REQUIRED_RELATIVE_ERROR,
    SOLVER_TABLES,
    SolverTable,
    choose_inverse_root_method,
    explain_choice,
)

SPEED = Path(__file__).resolve().parents[2] / "benchmarks" / "speed"
RESULTS = SPEED / "results" / "solver_choice_cpu.json"
DEVICE_TYPES = ("cpu", "cuda", "cuda:1", "mps", "xpu", "meta")
SIZES = (1, 2, 15, 16, 17, 31, 100, 128, 129, 500, 1000, 1024, 1025, 2048, 2049, 4096, 100_000)


@pytest.fixture(scope="module")
def measured() -> dict:
    return json.loads(RESULTS.read_text())


@pytest.fixture(scope="module")
def benchmark():
    """``benchmarks/speed/solver_choice.py`` loaded by path (only its constants and pure helpers are used)."""
    spec = importlib.util.spec_from_file_location("solver_choice_benchmark", SPEED / "solver_choice.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", DEVICE_TYPES)
def test_every_device_and_size_gets_a_known_solver(device):
    for size in SIZES:
        assert choose_inverse_root_method(device, size) in INVERSE_ROOT_METHODS
        assert choose_inverse_root_method(torch.device(device), size) == choose_inverse_root_method(device, size)


def test_cpu_table_is_the_measured_winners(measured):
    winners = {int(size): method for size, method in measured["winners"].items()}
    assert dict(CPU_TABLE.choices) == winners
    for size, method in winners.items():
        assert choose_inverse_root_method("cpu", size) == method


def test_cpu_table_cites_the_run_it_records(measured, benchmark):
    meta = measured["meta"]
    assert meta["device"] == "cpu"
    assert meta["required_relative_error"] == REQUIRED_RELATIVE_ERROR == benchmark.REQUIRED_RELATIVE_ERROR
    assert meta["torch"] in CPU_TABLE.source and meta["date"] in CPU_TABLE.source
    assert "benchmarks/speed/solver_choice.py" in CPU_TABLE.source
    assert [size for size, _ in CPU_TABLE.choices] == list(benchmark.BLOCK_SIZES)


def test_recorded_winners_are_the_fastest_qualifying_records(measured, benchmark):
    records = [benchmark.Record(**record) for record in measured["records"]]
    assert benchmark.winners(records) == measured["winners"]
    for record in records:
        assert record.method in INVERSE_ROOT_METHODS
        accurate = max(record.well_error, record.deficient_error) <= REQUIRED_RELATIVE_ERROR
        accepted = record.well_rejected == record.deficient_rejected == 0
        assert record.qualifies == (record.method == "eigh" or (accurate and accepted))
    sizes = {record.block_size for record in records}
    assert all({r.method for r in records if r.block_size == size} == set(INVERSE_ROOT_METHODS) for size in sizes)


def test_buckets_use_the_smallest_recorded_size_at_least_as_large():
    table = SolverTable(choices=((16, "eigh"), (64, "newton_db"), (256, "coupled_newton")), source="test")
    expected = {1: 16, 15: 16, 16: 16, 17: 64, 63: 64, 64: 64, 65: 256, 256: 256, 257: 256, 10_000: 256}
    assert {size: table.bucket(size) for size in expected} == expected
    assert [table.method_for(size) for size in (16, 17, 64, 65, 257)] == [
        "eigh",
        "newton_db",
        "newton_db",
        "coupled_newton",
        "coupled_newton",
    ]


def test_cpu_buckets_between_and_beyond_the_recorded_sizes():
    assert CPU_TABLE.bucket(1) == 16
    assert CPU_TABLE.bucket(100) == 128
    assert CPU_TABLE.bucket(1025) == 2048
    assert CPU_TABLE.bucket(4096) == CPU_TABLE.bucket(100_000) == 2048
    for size in (100, 1025, 4096):
        assert choose_inverse_root_method("cpu", size) == CPU_TABLE.method_for(CPU_TABLE.bucket(size))


def test_cuda_uses_newton_db_and_other_devices_fall_back():
    assert set(SOLVER_TABLES) == {"cpu", "cuda"}
    assert {method for _, method in CUDA_TABLE.choices} == {"newton_db"}
    assert {choose_inverse_root_method("cuda:0", size) for size in SIZES} == {"newton_db"}
    assert FALLBACK_METHOD == "eigh"
    assert {choose_inverse_root_method(device, size) for device in ("mps", "meta") for size in SIZES} == {"eigh"}


def test_explain_choice_is_one_line_naming_method_size_device_and_source():
    cpu = explain_choice("cpu", 1024)
    assert cpu.startswith(f"auto -> {CPU_TABLE.method_for(1024)} for 1024-blocks on cpu (measured: ")
    assert "benchmarks/speed/solver_choice.py" in cpu
    assert explain_choice(torch.device("cuda", 1), 512).startswith("auto -> newton_db for 512-blocks on cuda (")
    assert explain_choice("mps", 8).startswith("auto -> eigh for 8-blocks on mps (")
    assert all("\n" not in explain_choice(device, 64) for device in DEVICE_TYPES)


@pytest.mark.parametrize("size", [0, -3, True, 2.0, "64"])
def test_bad_block_sizes_are_refused(size):
    with pytest.raises(ValueError, match="block_size"):
        choose_inverse_root_method("cpu", size)


@pytest.mark.parametrize(
    "choices",
    [(), ((64, "eigh"), (16, "eigh")), ((16, "eigh"), (16, "newton_db")), ((0, "eigh"),), ((16, "auto"),)],
)
def test_malformed_tables_are_refused(choices):
    with pytest.raises(ValueError):
        SolverTable(choices=choices, source="test")

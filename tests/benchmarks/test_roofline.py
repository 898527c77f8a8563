"""Closed-form checks of the H100 roofline model (``benchmarks/speed/roofline.py``); nothing is timed.

Each check recomputes a count independently of the script's own helpers: the FLOPs of one
block's statistics, the blocks covering every matrix parameter exactly once, AdamW's bytes
per element, published parameter counts, and the roofline's max of two limits.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import _roofline_counts as counts
import roofline


def test_statistics_and_direction_flops_of_one_square_block():
    # L += G G^T and R += G^T G: two 1024^3 products of 2 FLOPs per multiply-add.
    assert counts.statistics_flops(1024, 1024) == 2 * 2 * 1024**3
    assert counts.direction_flops(1024, 1024) == 2 * 2 * 1024**3
    # A 1024 x 256 block: G G^T is 1024 x 1024 over 256 (2 * 1024^2 * 256), G^T G is 256 x 256 over 1024.
    assert counts.statistics_flops(1024, 256) == 2 * 1024 * 1024 * 256 + 2 * 256 * 256 * 1024


@pytest.mark.parametrize("block_size", [1024, 512, 1000])
@pytest.mark.parametrize("model", list(counts.MODELS))
def test_blocks_cover_every_matrix_parameter_once(model, block_size):
    shapes = [shape for _, shape in counts.MODELS[model]]
    blocks = counts.block_counts(shapes, block_size)
    matrix_elements = sum(math.prod(shape) for shape in shapes if len(shape) >= 2)
    assert sum(rows * cols * n for (rows, cols), n in blocks.items()) == matrix_elements
    assert all(rows <= block_size and cols <= block_size for rows, cols in blocks)
    tiles = sum(math.ceil(s[0] / block_size) * math.ceil(math.prod(s[1:]) / block_size) for s in shapes if len(s) >= 2)
    assert sum(blocks.values()) == tiles
    assert counts.vector_elements(shapes) + matrix_elements == sum(math.prod(shape) for shape in shapes)


def test_published_parameter_counts():
    count = {name: sum(math.prod(shape) for _, shape in shapes) for name, shapes in counts.MODELS.items()}
    assert count["gpt2-125m"] == 124_439_808  # GPT-2 small, head tied to the embedding
    assert count["llama3-8b"] == 8_030_261_248  # Meta-Llama-3-8B
    llama = dict(counts.MODELS["llama3-8b"])
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert llama["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert llama["lm_head.weight"] == (128256, 4096)
    assert not any("q_norm" in name or "k_norm" in name for name in llama)
    assert 1.2e9 < count["gpt-1.3b"] < 1.4e9


def test_adamw_bytes_per_element():
    # Read parameter, gradient, m, v; write parameter, m, v. m and v are fp32.
    for param_bytes in (2, 4):
        reads = 2 * param_bytes + 2 * 4
        writes = param_bytes + 2 * 4
        assert counts.adamw_bytes_per_element(param_bytes) == reads + writes
    assert counts.adamw_bytes_per_element(2) == 22 and counts.adamw_bytes_per_element(4) == 28


def test_commit_passes_of_one_block():
    # momentum, second moment (m x n each), L (m x m), R (n x n): read old, read new, write, in fp32.
    assert counts.block_commit_bytes(1024, 256) == 3 * 4 * (2 * 1024 * 256 + 1024**2 + 256**2)


def test_newton_root_flops_follow_the_planned_iterations():
    iterations = counts.newton_db_iterations(torch.float32, 1024)
    assert 2 <= iterations <= 2 * 40  # two passes, each at most the planner's maximum
    assert counts.newton_db_iterations(torch.bfloat16, 1024) < iterations  # a higher noise floor: fewer steps
    assert counts.newton_root_flops(1024, iterations) == 4 * (iterations - 1) * 2 * 1024**3


def test_roofline_takes_the_binding_limit():
    assert roofline.roofline_ms(2e12, 1.0, 1e15, 1e12) == pytest.approx(2.0)  # compute-bound: 2 ms
    assert roofline.roofline_ms(1.0, 3e9, 1e15, 1e12) == pytest.approx(3.0)  # memory-bound: 3 ms
    part = roofline.Part("p")
    part.add(2e12, 1.0, 1e15, 1e12)
    part.add(1.0, 1e9, 1e15, 1e12, share=0.5)
    assert part.ms == pytest.approx(2.5) and part.memory_ms == pytest.approx(0.5) and part.bound == "compute"


def test_report_layout_and_ratios(tmp_path):
    report = roofline.main(["--models", "gpt2-125m", "--frequencies", "1", "10", "--out", str(tmp_path)])
    assert json.loads((tmp_path / roofline.RESULTS_NAME).read_text()) == json.loads(json.dumps(report))
    records = report["records"]
    assert {(r["frequency"], r["column"]) for r in records} == {
        (f, c) for f in (1, 10) for c in ("bf16", "tf32", "fp32")
    }
    for record in records:
        assert record["overhead"] == pytest.approx(record["dash_ms"] / record["adamw_ms"])
        assert record["dash_ms"] == pytest.approx(sum(part["ms"] for part in record["parts"]))
        assert record["dash_ms_without_commit"] < record["dash_ms"]
        # AdamW: 124,439,808 elements at 22 or 28 bytes over 3.35 TB/s.
        per_element = 22 if record["column"] == "bf16" else 28
        assert record["adamw_ms"] == pytest.approx(1e3 * 124_439_808 * per_element / 3.35e12)
    by_f = {(r["frequency"], r["column"]): r for r in records}
    # Roots amortised over f: their FLOPs shrink ten-fold, the rest stays.
    roots = {f: next(p["gflop"] for p in by_f[(f, "tf32")]["parts"] if p["name"] == "root matmuls") for f in (1, 10)}
    assert roots[10] == pytest.approx(roots[1] / 10)


def test_spectral_grafting_reads_are_the_products_the_package_takes(monkeypatch):
    """``SPECTRAL_READS`` is how many products over a whole block one spectral graft takes, counted by
    running the package's own ``graft_spectral`` with ``torch.linalg.vecdot`` watched."""
    from lightning_dash.optim.step import grafting

    operands = []
    vecdot = torch.linalg.vecdot

    def watched(blocks, vectors, **options):
        operands.append(tuple(blocks.shape))
        return vecdot(blocks, vectors, **options)

    monkeypatch.setattr(torch.linalg, "vecdot", watched)
    grafting.graft_spectral(torch.randn(3, 8, 5), torch.randn(3, 8, 5))
    assert operands == [(3, 8, 5)] * counts.SPECTRAL_READS
    assert counts.spectral_grafting_flops(8, 5) == 2 * counts.SPECTRAL_READS * 8 * 5

"""Quick checks of the benchmark scripts and their shared helpers (nothing is timed).

The per-block loop baseline must compute DASH's update, or the step-time
comparison is not fair; the record builders must emit exactly the documented
layout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "numerics"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "races"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import _step_time_cases as step_cases
import _step_time_measure as step_measure
import _timing as timing
import common
import convergence
import step_time
from _shampoo_loop import ShampooLoop, block_slices

from lightning_dash import DASH
from lightning_dash.distributed import block_shapes

STEP_TIME_KEYS = {
    "device": str,
    "model": str,
    "optimizer": str,
    "solver": (str, type(None)),
    "dtype": (str, type(None)),
    "block_size": (int, type(None)),
    "step_ms": float,
}
CONVERGENCE_KEYS = {
    "device": str,
    "optimizer": str,
    "lr": float,
    "seed": int,
    "steps": int,
    "final_val_loss": float,
    "steps_to_adamw_final": (int, type(None)),
    "wall_s": float,
}


def check_layout(record: dict, keys: dict) -> None:
    assert set(record) == set(keys)
    for key, kind in keys.items():
        assert isinstance(record[key], kind), (key, record[key])
        assert not isinstance(record[key], bool), key


def test_block_slices_cover_every_element_once():
    covered = torch.zeros(70, 45, dtype=torch.int64)
    for rows, cols in block_slices((70, 45), 32):
        covered[rows, cols] += 1
    assert bool((covered == 1).all())


@pytest.mark.parametrize("method", ["eigh", "newton_db", "coupled_newton", "chebyshev"])
def test_shampoo_loop_matches_dash(method):
    """Same blocks, same solver, roots at every step: the same parameters after a few steps."""
    torch.manual_seed(0)
    shapes = [(40, 24), (24,), (70, 30), (30, 70), (5, 3, 2, 2)]  # 4-D: a convolution, one (5, 12) matrix
    initial = [torch.randn(shape) for shape in shapes]
    gradients = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
    options = {
        "lr": 0.01,
        "weight_decay": 0.1,
        "epsilon": 1e-6,
        "block_size": 32,
        "precondition_frequency": 1,
        "inverse_root_method": method,
    }
    batched = [p.clone().requires_grad_() for p in initial]
    looped = [p.clone().requires_grad_() for p in initial]
    dash, loop = DASH(batched, **options), ShampooLoop(looped, **options)
    for step_grads in gradients:
        for params in (batched, looped):
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
        dash.step()
        loop.step()
    for start, a, b in zip(initial, batched, looped):
        moved = (a - start).abs().max()
        assert moved > 0
        assert (a - b).abs().max() <= 1e-4 * moved


def test_shampoo_loop_skips_roots_between_refreshes():
    torch.manual_seed(1)
    initial = torch.randn(20, 12)
    grads = [torch.randn(20, 12) for _ in range(4)]
    a, b = initial.clone().requires_grad_(), initial.clone().requires_grad_()
    dash = DASH([a], lr=0.01, block_size=16, precondition_frequency=3, epsilon=1e-4)
    loop = ShampooLoop([b], lr=0.01, block_size=16, precondition_frequency=3, epsilon=1e-4)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        dash.step()
        loop.step()
    assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_step_time_records_have_the_documented_layout(tmp_path):
    args = step_time.parse_args(
        [
            "--device",
            "cpu",
            "--block-sizes",
            "8",
            "--solvers",
            "eigh",
            "newton_db",
            "--dtypes",
            "float32",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--samples",
            "1",
            "--no-third-party",
            "--out",
            str(tmp_path),
        ]
    )
    shapes = step_cases.gpt_parameter_shapes(step_cases.GPTShape(width=8, layers=1, vocab=16, context=4))
    params, grads = step_cases.make_parameters(shapes, torch.device("cpu"))
    cases, _ = step_cases.build_cases(args, max(max(s) for _, s in shapes))
    cpu = torch.device("cpu")
    tensors = {None: (params, grads)}
    step_measure.measure_models(cases, tensors, args.rounds, args.warmup, args.samples, cpu, verbose=False)
    records = step_measure.make_records(cases, "cpu", "tiny")
    names = [(r.optimizer, r.solver, r.block_size) for r in records]
    assert ("adamw", None, None) in names
    assert ("dash", "eigh", 8) in names and ("shampoo_loop", "newton_db", 8) in names
    assert ("dash_f10", "newton_db", 8) in names
    path = step_measure.write_records(records, tmp_path, "cpu")
    assert path.name == "step_time_cpu.json"
    for record in json.loads(path.read_text()):
        check_layout(record, STEP_TIME_KEYS)
    assert "loop / DASH" in step_measure.format_table(records)


PEER_KEYS = {
    "device": str,
    "model": str,
    "optimizer": str,
    "solver": str,
    "frequency": int,
    "block_size": int,
    "step_ms": float,
    "ratio": (float, type(None)),
}
NO_META = "distributed_shampoo (Meta's Distributed Shampoo, installed by make bench-step) is not importable"


def test_step_time_peers_suite_writes_its_layout(tmp_path):
    """``--suite peers`` end to end on the tiny model: DASH (eigh and its default solver) and
    meta_shampoo at two frequencies, records with the documented layout and ratios."""
    pytest.importorskip("distributed_shampoo", reason=NO_META)
    assert step_cases.parameter_count(step_cases.model_parameter_shapes("gpt-6.6m")) == 6_646_272
    assert step_cases.model_parameter_shapes("matrices-8x1024") == [(f"matrix.{i}", (1024, 1024)) for i in range(8)]
    args = step_time.parse_args(
        [
            "--suite",
            "peers",
            "--device",
            "cpu",
            "--models",
            "gpt-tiny",
            "--block-sizes",
            "32",
            "--frequencies",
            "1",
            "2",
        ]
        + ["--rounds", "1", "--warmup", "0", "--samples", "1", "--out", str(tmp_path)]
    )
    records = step_time.main_peers(args)
    default = step_cases.default_inverse_root_method()
    assert [(r.optimizer, r.solver, r.frequency) for r in records] == [
        ("dash", "eigh", 1),
        ("dash_default", default, 1),
        ("dash_compiled", default, 1),
        ("meta_shampoo", "eigh", 1),
        ("dash", "eigh", 2),
        ("dash_default", default, 2),
        ("dash_compiled", default, 2),
        ("meta_shampoo", "eigh", 2),
    ]
    path = tmp_path / "step_time_peers_cpu.json"
    for record, row in zip(records, json.loads(path.read_text())):
        check_layout(row, PEER_KEYS)
        assert row["model"] == "gpt-tiny" and row["block_size"] == 32 and row["step_ms"] > 0
        meta_ms = next(r.step_ms for r in records if r.optimizer == "meta_shampoo" and r.frequency == record.frequency)
        if record.optimizer == "meta_shampoo":
            assert row["ratio"] is None
        else:
            assert row["ratio"] == pytest.approx(meta_ms / record.step_ms)
    assert "meta / this" in step_measure.format_peer_table(records)


def test_meta_shampoo_matches_dash_on_matrices():
    """The matched settings are the same optimizer on matrices: with the same absolute damping and
    roots at every step, Meta's Shampoo and DASH move every matrix alike (vectors differ by
    design: DASH gives them Adam, Meta the momentum at Adam's norm; see _meta_shampoo.py)."""
    pytest.importorskip("distributed_shampoo", reason=NO_META)
    import _meta_shampoo

    torch.manual_seed(0)
    shapes = [(40, 24), (70, 30), (24,)]
    initial = [torch.randn(shape) for shape in shapes]
    gradients = [[torch.randn(shape) for shape in shapes] for _ in range(4)]
    shared = {"lr": 0.01, "betas": (0.9, 0.999), "block_size": 32, "precondition_frequency": 1}
    grafting = {"grafting_beta2": 0.999, "grafting_epsilon": 1e-8}
    ours, theirs = [p.clone().requires_grad_() for p in initial], [p.clone().requires_grad_() for p in initial]
    # Meta's Shampoo takes fourth roots and plain momentum (DASH's defaults before version 0.4).
    dash = DASH(
        ours,
        **shared,
        **grafting,
        inverse_root_method="eigh",
        epsilon=1e-6,
        relative_epsilon=False,
        root_order=4,
        nesterov=False,
        grafting_norm="frobenius",  # Meta grafts Adam's Frobenius norm
        lr_scale=1.0,  # and steps it at the lr itself
    )
    meta = _meta_shampoo.build_meta_shampoo(theirs, **shared, **grafting, epsilon=1e-6)
    for step_grads in gradients:
        for params in (ours, theirs):
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
        dash.step()
        meta.step()
    for start, a, b in zip(initial[:2], ours, theirs):
        moved = (a - start).abs().max()
        assert moved > 0
        assert (a - b).abs().max() <= 1e-3 * moved


def test_gpu_labels():
    assert common.short_gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert common.short_gpu_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert common.short_gpu_name("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert common.short_gpu_name("NVIDIA H200") == "h200"
    assert common.device_label(torch.device("cpu")) == "cpu"


def test_convergence_records_have_the_documented_layout(tmp_path):
    settings = convergence.Settings(
        steps=4,
        warmup=2,
        batch_size=4,
        context=8,
        width=8,
        depth=1,
        heads=2,
        eval_every=2,
        eval_batches=1,
        corpus_bytes=100_000,
    )
    corpus = convergence.load_stdlib_corpus(max_bytes=settings.corpus_bytes)
    cpu = torch.device("cpu")
    grid = [("adamw", 1e-3, 0), ("adamw", 3e-3, 0), ("dash", 3e-3, 0), ("adamw", 3e-3, 1), ("dash", 3e-3, 1)]
    runs = [convergence.train_run(name, lr, seed, corpus, settings, cpu) for name, lr, seed in grid]
    assert [p.step for p in runs[0].curve] == [0, 2, 4]
    records = convergence.make_records(runs, "cpu")
    assert len(records) == len(grid)
    best = convergence.best_lrs(runs)
    for record in records:
        if record.optimizer == "adamw" and record.lr == best["adamw"]:
            assert record.steps_to_adamw_final is not None and record.steps_to_adamw_final <= record.steps
    paths = convergence.write_outputs(runs, records, tmp_path, "cpu", "test")
    assert [p.name for p in paths] == ["convergence_cpu.json", "convergence_curves_cpu.json", "convergence_cpu.png"]
    for record in json.loads(paths[0].read_text()):
        check_layout(record, CONVERGENCE_KEYS)
    curves = json.loads(paths[1].read_text())
    assert set(curves[0]) == {"device", "optimizer", "lr", "seed", "median_step_ms", "curve"}
    assert set(curves[0]["curve"][0]) == {"step", "wall_s", "val_loss"}
    ratio = convergence.dash_over_adamw(runs)
    assert ratio.seeds == [0, 1] and len(ratio.steps) == len(ratio.wall) == len(ratio.median_time) == 2


def test_robust_step_time_keeps_root_steps_amortised():
    steps = ([1.0] + [0.1] * 9) * 3 + [50.0] * 10 + [0.1] * 3  # one slowed-down window, a partial one
    assert timing.robust_step_ms(steps, convergence.DASH_FREQUENCY) == pytest.approx(1e3 * 1.9 / 10)


def test_warmup_cosine_schedule():
    factor = common.warmup_cosine(warmup=4, total=20)
    assert factor(0) == pytest.approx(0.25)
    assert factor(3) == pytest.approx(1.0)
    assert factor(4) == pytest.approx(1.0)
    assert factor(12) == pytest.approx(0.5)
    assert factor(20) == pytest.approx(0.0, abs=1e-12)


def test_build_optimizer_passes_hyperparameters_and_rejects_unknown_names():
    params = [torch.zeros(4, 3, requires_grad=True)]
    adamw = common.build_optimizer("adamw", params, lr=0.5, betas=(0.8, 0.9))
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["lr"] == 0.5 and adamw.defaults["betas"] == (0.8, 0.9)
    assert isinstance(common.build_optimizer("dash", params, lr=0.5, block_size=8), DASH)
    with pytest.raises(ValueError, match="unknown optimizer"):
        common.build_optimizer("sgd", params, lr=0.5)
    options = convergence.hyperparameters("dash", 3e-3)
    assert options["block_size"] == convergence.DASH_BLOCK_SIZE and options["grafting_beta2"] == 0.95


def test_tables_and_json(tmp_path):
    assert common.format_columns(["a", "bbb"], [["10", "2"]]) == " a  bbb\n10    2"
    assert common.markdown_table(["x", "y"], [[1, "-"]]).splitlines() == ["| x | y |", "|---|---|", "| 1 | - |"]
    record = step_measure.Record("cpu", "m", "adamw", None, None, None, 1.5)
    path = common.write_json(tmp_path / "sub" / "out.json", [record, {"k": 1}], indent=1)
    assert path.read_text().endswith("\n")
    assert json.loads(path.read_text())[1] == {"k": 1} and json.loads(path.read_text())[0]["step_ms"] == 1.5


def test_compare_revisions_summary_pairs_rounds():
    import compare_revisions

    def run(round_, revision, adamw_ms, dash_ms=None):
        records = [
            {
                "device": "cpu",
                "model": "m",
                "optimizer": "adamw",
                "solver": None,
                "dtype": None,
                "block_size": None,
                "step_ms": adamw_ms,
            }
        ]
        if dash_ms is not None:
            records.append(
                {
                    "device": "cpu",
                    "model": "m",
                    "optimizer": "dash",
                    "solver": "eigh",
                    "dtype": "float32",
                    "block_size": 32,
                    "step_ms": dash_ms,
                }
            )
        return {"round": round_, "revision": revision, "wall_s": 1.0, "records": records, "skipped": []}

    runs = [
        run(1, "before", 1.0, 10.0),
        run(1, "after", 2.0, 12.0),
        run(2, "before", 2.0, 10.0),
        run(2, "after", 2.0),
        run(3, "before", 4.0, 30.0),
        run(3, "after", 2.0, 15.0),
    ]
    adamw, dash = compare_revisions.summarize(runs, rounds=3)
    assert adamw["before_ms"] == [1.0, 2.0, 4.0] and adamw["after_ms"] == [2.0, 2.0, 2.0]
    assert adamw["before_median_ms"] == 2.0 and adamw["ratio"] == 1.0
    assert (adamw["ratio_min"], adamw["ratio_max"]) == (0.5, 2.0)
    assert dash["after_ms"] == [12.0, None, 15.0] and dash["after_median_ms"] == 13.5
    assert dash["ratio"] == pytest.approx(13.5 / 10.0)  # medians: 10 of (10, 10, 30) before
    assert (dash["ratio_min"], dash["ratio_max"]) == (0.5, 1.2)  # rounds 1 and 3 only
    table = compare_revisions.format_summary([adamw, dash])
    assert "dash eigh float32 b32" in table and "0.500-1.200" in table

    args = compare_revisions.parse_args(["--before", "abc", "--", "--model", "gpt-tiny"])
    assert args.after is None and args.step_time_args == ["--model", "gpt-tiny"]
    assert compare_revisions.parse_args(["--before", "abc"]).step_time_args == compare_revisions.DEFAULT_STEP_TIME_ARGS
    with pytest.raises(SystemExit):
        compare_revisions.parse_args(["--before", "abc", "--", "--out", "x"])


@pytest.mark.multiprocess
def test_compare_revisions_tiny_run_writes_its_layout(tmp_path, monkeypatch):
    """HEAD (a temporary worktree) against the working tree, one round of the tiny model."""
    import compare_revisions

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors: a second thread only waits on a busy machine
    out = tmp_path / "compare.json"
    report = compare_revisions.main(
        [
            "--before",
            "HEAD",
            "--rounds",
            "1",
            "--out",
            str(out),
            "--",
            "--model",
            "gpt-tiny",
            "--block-sizes",
            "32",
            "--solvers",
            "eigh",
            "--dtypes",
            "float32",
            "--warmup",
            "0",
            "--samples",
            "1",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report) == {"before", "after", "machine", "step_time_args", "runs", "cases"}
    assert len(report["before"]["commit"]) == 40 and report["after"]["rev"] == "working tree"
    assert report["before"]["package"] != report["after"]["package"]
    assert {"platform", "cpu_count", "torch"} <= set(report["machine"])
    assert [(r["round"], r["revision"]) for r in report["runs"]] == [(1, "before"), (1, "after")]
    for record in report["runs"][0]["records"]:
        check_layout(record, STEP_TIME_KEYS)
    assert [compare_revisions.case_label(compare_revisions.case_key(c)) for c in report["cases"]] == [
        "gpt-tiny adamw",
        "gpt-tiny dash eigh float32 b32",
        "gpt-tiny dash_f10 newton_db float32 b32",
    ]
    assert all(c["ratio"] > 0 and len(c["before_ms"]) == 1 for c in report["cases"])


@pytest.mark.multiprocess
def test_fsdp_smoke_run_matches_its_plan(tmp_path):
    """Two gloo ranks of a tiny FSDP2 GPT: the measured state and traffic are the plan
    ``fsdp_estimate`` computes from the shapes, and FSDP2's counted traffic is the formula's."""
    import fsdp

    out = tmp_path / "fsdp.json"
    argv = ["--smoke", "--world-sizes", "2", "--warmup", "1", "--rounds", "1", "--steps-per-round", "2"]
    report = fsdp.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (record,) = report["records"]
    assert record["world_size"] == 2 and record["blocks"] > 2
    assert record["matches_plan"] and record["state_bound_holds"] and record["nonfinite_skips"] == 0
    assert record["fsdp_counted_bytes_per_step"] == record["fsdp_bytes_per_step"] > 0
    assert record["dash_state_bytes_total"] == sum(record["dash_state_bytes"])
    assert 0 < record["dash_bytes_sent_per_step_max"] < record["fsdp_bytes_per_step"]
    assert record["adamw_step_ms"] > 0 and record["dash_step_ms"] > 0 and record["ownership_balance"] >= 1.0


def small_qwen3(est, layers: int = 2):
    """Qwen3's layout at widths a test plans in milliseconds."""
    return est.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=203,
    )


def test_fsdp_estimate_of_a_small_qwen3(tmp_path):
    """Shapes only: every block's state is on exactly one rank, whatever the world size,
    and one rank sends nothing."""
    import fsdp_estimate as est

    config = small_qwen3(est)
    names = [name for name, _ in est.qwen3_parameters(config)]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert len(names) == 3 + 11 * 2
    records = [est.estimate(config, world_size, block_size=32) for world_size in (1, 3, 5)]
    assert records[0]["dash_bytes_sent_per_step_max"] == 0 and records[0]["fsdp_bytes_per_step"] == 0
    vectors = 8 * (2 * (16 + 16 + 64 + 64) + 64)  # q/k norms and layer norms of two layers, final norm
    assert (
        records[0]["dash_state_bytes_total"]
        == sum(
            est.block_state_bytes(*shape) for shape in block_shapes([s for _, s in est.qwen3_parameters(config)], 32)
        )
        + vectors
    )
    for record in records[1:]:
        assert record["dash_state_bytes_total"] == records[0]["dash_state_bytes_total"]
        assert record["dash_state_bytes_max"] >= record["dash_state_bytes_mean"]
        assert record["adamw_state_bytes_mean"] == pytest.approx(8 * record["parameters"] / record["world_size"])
        assert 0 < record["dash_bytes_sent_per_step_mean"] < record["fsdp_bytes_per_step"]
    report = est.main(["--world-sizes", "2", "--block-size", "1024", "--out", str(tmp_path / "e.json")])
    assert report["records"][0]["parameters"] == 8_190_735_360


def test_tensor_parallel_estimate_of_a_small_qwen3():
    """Shapes only, on data-parallel x tensor-parallel meshes: every block is owned once, the
    norms' buffers are held once per tensor-parallel rank, and one rank sends nothing."""
    import fsdp_estimate as est
    from _tensor_parallel_plan import tensor_parallel_plan

    config = small_qwen3(est)
    named = est.qwen3_parameters(config)
    single = tensor_parallel_plan(named, 1, 1, block_size=32)
    assert single["dash_bytes_sent_per_step_max"] == 0 and single["fsdp_bytes_per_step"] == 0
    vector_elements = sum(shape[0] for _, shape in named if len(shape) == 1)
    for dp, tp in [(2, 2), (1, 4), (4, 1), (3, 2)]:
        plan = tensor_parallel_plan(named, dp, tp, block_size=32)
        total = plan["dash_state_bytes_mean"] * plan["world_size"]
        assert total == single["dash_state_bytes_mean"] + 8 * (tp - 1) * vector_elements
        assert plan["blocks"] == single["blocks"] and plan["state_bound_holds"]
        assert 0 < plan["dash_bytes_sent_per_step_max"] and (plan["fsdp_bytes_per_step"] > 0) == (dp > 1)
        # One round: every owned block's gradient and update at once; micro-groups: within the budget.
        assert plan["micro_groups"] == 1 and plan["peak_gathered_bytes_max"] == 2 * plan["gathered_bytes_max"]
        budgeted = tensor_parallel_plan(named, dp, tp, block_size=32, micro_group_mib=0.05)
        assert budgeted["micro_groups"] > 1 and budgeted["peak_gathered_bytes_max"] <= 0.05 * 2**20


def test_the_tensor_parallel_estimate_counts_what_each_rank_exchange_sends():
    """The per-rank bytes the estimate adds up from all pieces equal each rank's own exchange's."""
    import fsdp_estimate as est
    from _tensor_parallel_plan import mesh_plan, tensor_parallel_plan

    from lightning_dash.distributed.piece_exchange import exchange_for

    config = small_qwen3(est, layers=1)
    named = est.qwen3_parameters(config)
    estimate = tensor_parallel_plan(named, 2, 2, block_size=32)
    plan = mesh_plan(named, 2, 2, block_size=32)
    sent = [4 * exchange_for(plan.gradients, plan.updates, rank, plan.holdings).elements_sent() for rank in range(4)]
    assert estimate["dash_bytes_sent_per_step_max"] == max(sent) > 0
    assert estimate["dash_bytes_sent_per_step_mean"] == sum(sent) / 4


def test_recurrent_routing_tiny_run_writes_its_layout(tmp_path):
    """Three steps of AdamW and of DASH at the defaults on the byte-level GRU, in this process."""
    import recurrent_routing

    threads = torch.get_num_threads()
    try:
        summary = recurrent_routing.main(
            ["--lrs", "0.05", "--seeds", "0", "--steps", "3", "--contenders", "adamw", "dash"]
            + ["--records", str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "summary.json")]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert set(summary["stamp"]) == {"device", "date", "commit", "torch"}
    adamw, dash = summary["rows"]
    assert (adamw["contender"], dash["contender"]) == ("adamw", "dash")
    assert adamw["seeds"] == dash["seeds"] == [0] and adamw["final_val"] != dash["final_val"]
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [len(r["train_every_10"]) for r in records] == [1, 1]
    assert all(r["failed"] == (r["final_val"] > recurrent_routing.FAILED_ABOVE) for r in records)


def test_roundoff_separates_the_optimizers_arithmetic_from_the_models(tmp_path):
    """On the parity MLP (10 steps, seed 0): an unperturbed rerun lands exactly where the first run
    did, at either optimizer dtype (the measure is deterministic); with the perturbation, float64
    arithmetic in DASH moves the parameters less than float32 arithmetic does, and float32 less than it
    moves torch's Muon (the rule DASH's defaults are held to)."""
    import roundoff

    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.float64):
            assert roundoff.trajectory_change("parity_mlp", {}, 10, 0, size=0.0, optimizer_dtype=dtype) == 0.0
        records = roundoff.main(
            ["--networks", "parity_mlp", "--steps", "10", "--seeds", "1", "--optimizer-dtype", "float32", "float64"]
            + ["--out", str(tmp_path / "roundoff.json")]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "roundoff.json").read_text()) == records
    float32, float64 = records
    assert (float32["optimizer_dtype"], float64["optimizer_dtype"]) == ("float32", "float64")
    assert {"device", "date", "commit", "torch"} <= set(float32)
    muon = roundoff.trajectory_change("parity_mlp", {}, 10, 0, optimizer_kind="muon")
    assert float32["per_seed"] == [float32["change"]] and 0 < float32["change"] < muon
    assert 0 < float64["change"] < float32["change"] / 3


def test_roundoff_halves_average_the_two_half_batches_gradients():
    """The gradient two data-parallel ranks average equals the whole batch's to float32 roundoff, and
    training on it moves DASH's defaults no further from the single-process run than it moves torch's Muon."""
    import roundoff

    spec = roundoff.NETWORKS["parity_mlp"]
    x, y = spec.batches(1, 0)[0]
    model = roundoff.parity_mlp()
    grads = []
    for halves in (False, True):
        roundoff.batch_gradients(model, spec.loss, x, y, halves)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    whole, averaged = grads
    assert whole.norm() > 0 and (averaged - whole).norm() <= 1e-6 * whole.norm()
    threads = torch.get_num_threads()
    try:
        change = roundoff.trajectory_change("parity_mlp", {}, 10, 0, perturbation="halves")
        muon = roundoff.trajectory_change("parity_mlp", {}, 10, 0, perturbation="halves", optimizer_kind="muon")
    finally:
        torch.set_num_threads(threads)
    assert 0 < change < muon
    with pytest.raises(ValueError, match="perturbation must be one of"):
        roundoff.trajectory_change("parity_mlp", {}, 1, 0, perturbation="half")


def test_roundoff_measures_the_peers_on_the_same_footing(tmp_path):
    """``--optimizer adamw`` / ``muon`` perturb AdamW's and Muon's own trajectories: unperturbed reruns
    land exactly where the first runs did, and the records name the optimizer and no DASH option."""
    import roundoff

    threads = torch.get_num_threads()
    try:
        for kind in ("adamw", "muon"):
            assert roundoff.trajectory_change("parity_mlp", {}, 4, 0, size=0.0, optimizer_kind=kind) == 0.0
        records = roundoff.main(
            ["--optimizer", "adamw", "--networks", "parity_mlp", "--steps", "4", "--seeds", "1"]
            + ["--epsilons", "1e-3", "1e-4", "--perturbations", "relative", "halves"]
            + ["--out", str(tmp_path / "roundoff.json")]
        )
    finally:
        torch.set_num_threads(threads)
    # One run per perturbation: DASH's option axes do not multiply a peer's runs.
    assert [r["perturbation"] for r in records] == ["relative", "halves"]
    for record in records:
        assert record["optimizer"] == "adamw" and record["epsilon"] is None and 0 < record["change"] < 1e-4

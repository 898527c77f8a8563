"""The convergence race (benchmarks/races/peers.py) on a tiny model, so that its harness cannot rot.

A few steps at width 32 with two learning rates per contender: the records, the table, the
plot, the merge of a second run into the first one's JSON, and the analysis (steps to AdamW's
final loss, best learning rate, lr transfer) on constructed curves. heavyball's and Meta's
contenders run only where those packages are importable.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "races"))

import _peers_analysis as analysis
import _peers_contenders as contenders
import _peers_train as race
import peers

#: The loss of a uniform prediction over 256 bytes, about where an untrained model starts.
UNIFORM_LOSS = math.log(256)
TINY = [
    "--widths",
    "32",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--val-windows",
    "64",
    "--context",
    "32",
    "--max-bytes",
    "300000",
    "--seeds",
    "0",
    "--extend-edges",
    "0",
]


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_tiny_race_records_table_plot_and_merge(tmp_path, capsys):
    grids = {"adamw": [3e-3, 1e-2], "dash-eigh": [6e-3, 2e-2]}
    flags = [word for name, lrs in grids.items() for word in (f"--lrs-{name}", *map(str, lrs))]
    summary = peers.main([*TINY, "--out", str(tmp_path), "--optimizers", "adamw,dash-eigh", *flags])
    path = tmp_path / "peers_cpu.json"
    records = read(path)["records"]
    assert sorted((r["optimizer"], r["lr"]) for r in records) == sorted(
        (name, lr) for name, lrs in grids.items() for lr in lrs
    )
    for record in records:
        assert record["status"] == "ok" and record["width"] == 32 and record["seed"] == 0 and record["steps"] == 6
        assert [step for step, _, _ in record["curve"]] == [0, 3, 6]
        losses = [loss for _, _, loss in record["curve"]]
        assert all(math.isfinite(loss) for loss in losses)
        assert abs(record["initial_val_loss"] - UNIFORM_LOSS) < 0.5
        assert record["final_val_loss"] == losses[-1]
        assert record["opt_step_ms"] > 0 and record["state_bytes"] > 0
    best = {row["optimizer"]: row for row in summary["widths"]["w32_s6"]["rows"]}
    for name, row in best.items():
        assert row["final_val_loss_mean"] < UNIFORM_LOSS - 0.3, name  # training works
    # AdamW keeps two float32 moments per parameter (and a step counter per tensor).
    params = records[0]["params"]
    assert 0 <= best["adamw"]["state_bytes"] - 2 * 4 * params <= 4 * 64
    # DASH counts its stacks itself (optimizer.state holds only step counters).
    assert best["dash-eigh"]["state_bytes"] > best["dash-eigh"]["state_bytes_walk"]
    printed = capsys.readouterr().out
    for name in grids:
        assert name in printed
    assert (tmp_path / "peers_cpu_w32.png").stat().st_size > 0

    # A second run adds a contender: the first run's records stay, the table lists all three.
    summary = peers.main([*TINY, "--out", str(tmp_path), "--optimizers", "muon", "--lrs-muon", "0.02", "0.05"])
    merged = read(path)["records"]
    assert {(r["optimizer"], r["lr"]) for r in records} <= {(r["optimizer"], r["lr"]) for r in merged}
    assert sorted(r["lr"] for r in merged if r["optimizer"] == "muon") == [0.02, 0.05]
    muon = next(r for r in merged if r["optimizer"] == "muon")
    assert muon["options"]["adamw_lr"] == best["adamw"]["best_lr"]  # AdamW's best lr, from the records
    names = [row["optimizer"] for row in summary["widths"]["w32_s6"]["rows"]]
    assert sorted(names) == ["adamw", "dash-eigh", "muon"]

    # --report-only rebuilds the summary from the JSON without running anything.
    again = peers.main(["--out", str(tmp_path), "--report-only"])
    assert read(path)["records"] == merged
    assert again["widths"]["w32_s6"]["rows"] == summary["widths"]["w32_s6"]["rows"]


def test_routing_variants_and_unavailable_options():
    settings = race.Settings(steps=2, context=16)
    model = race.make_model(32, 0, settings)
    tokens = torch.randint(0, 256, (4, 16))
    sizes = {}
    for name in ("dash-eigh", "dash-eigh-hidden"):
        optimizer = contenders.build(contenders.CONTENDERS[name], model, 1e-2, 6e-3)
        model.loss(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        sizes[name] = contenders.state_bytes(optimizer)
    # "hidden" leaves the byte embedding and the head (256 x 32 each) to the grafting optimizer.
    assert sizes["dash-eigh-hidden"] < sizes["dash-eigh"]
    # What strategy="dash" makes of AdamW: its recipe, the model's routing, every other option DASH's default.
    strategy = contenders.build(contenders.CONTENDERS["dash-strategy-defaults"], model, 6e-3, 6e-3)
    preconditioned = {name for name, view in strategy.preconditioning().items() if view is not None}
    assert preconditioned and not {"token.weight", "head.weight"} & preconditioned
    assert strategy.block_size == race_defaults_block_size() and strategy.param_groups[0]["lr"] == 6e-3
    # A variant's options override the shared ones; --dash-variant adds one from the command line.
    args = peers.parse_args(["--dash-variant", 'dash-f1={"precondition_frequency": 1, "lrs": [0.01]}'])
    assert args.optimizers == ["dash-f1"] and args.registry["dash-f1"].lrs == (0.01,)
    optimizer = contenders.build(args.registry["dash-f1"], model, 1e-2, 6e-3)
    assert optimizer.param_groups[0]["precondition_frequency"] == 1
    assert optimizer.param_groups[0]["weight_decay"] == contenders.WEIGHT_DECAY
    # --strategy-variant: the strategy's conversion of AdamW (routing, AdamW's lr) with some options set.
    args = peers.parse_args(["--strategy-variant", 'eps={"epsilon": 1e-4, "grafting_norm": "frobenius"}'])
    assert args.optimizers == ["eps"] and args.registry["eps"].family in peers.FROM_ADAMW
    converted = contenders.build(args.registry["eps"], model, 6e-3, 6e-3)
    assert converted.param_groups[0]["epsilon"] == 1e-4 and converted.config.grafting_norm == "frobenius"
    assert converted.param_groups[0]["lr"] == 6e-3 and converted.preconditioning()["head.weight"] is None
    unknown = contenders.Contender("dash-new", "dash", (1e-2,), {"no_such_option": 1})
    with pytest.raises(contenders.Unavailable):
        contenders.build(unknown, model, 1e-2, 6e-3)
    record = race.unavailable_record("dash-new", 32, 6, "no")
    # An unavailable record gives way when the optimizer runs later, other records stay.
    ran = {**record, "lr": 0.01, "seed": 0, "status": "ok"}
    kept = {**record, "width": 64}
    assert analysis.merge([record, kept], [ran]) == [kept, ran]


def race_defaults_block_size() -> int:
    from lightning_dash import DashConfig

    return DashConfig().block_size


def curve_record(name: str, lr: float, seed: int, losses: list[float | None], step_ms: float = 10.0) -> dict:
    """A record whose curve has the given losses at steps 0, 10, 20, ... (one second per 10 steps)."""
    return {
        "optimizer": name,
        "width": 8,
        "params": 100,
        "lr": lr,
        "seed": seed,
        "steps": 10 * (len(losses) - 1),
        "status": "ok",
        "final_val_loss": losses[-1],
        "wall_s": float(len(losses) - 1),
        "train_step_ms": step_ms,
        "train_step_robust_ms": step_ms,
        "opt_step_ms": 1.0,
        "opt_step_robust_ms": 1.0,
        "opt_step_median_ms": 1.0,
        "opt_step_mean_ms": 1.0,
        "state_bytes": 800,
        "state_bytes_walk": 800,
        "curve": [[10 * i, float(i), loss] for i, loss in enumerate(losses)],
    }


def test_steps_to_adamw_final_on_constructed_curves():
    record = curve_record("x", 1.0, 0, [5.5, 3.0, 2.5, 2.4])
    assert analysis.steps_to(record, 2.5).step == 20  # at or below
    assert analysis.steps_to(record, 2.45).step == 30
    assert analysis.steps_to(record, 6.0).step == 10  # step 0 never counts
    assert analysis.steps_to(record, 2.0) is None
    records = [
        curve_record("adamw", 1e-3, 0, [5.5, 3.0, 2.6, 2.5, 2.4]),
        curve_record("adamw", 2e-3, 0, [5.5, 2.9, 2.5, 2.3, 2.2]),  # best: reaches its own final at 40
        curve_record("adamw", 2e-3, 1, [5.5, 2.9, 2.6, 2.45, 2.3]),
        curve_record("dash", 2e-3, 0, [5.5, 2.6, 2.2, 2.0, 1.9], step_ms=20.0),  # 2.2 at step 20
        curve_record("dash", 4e-3, 0, [5.5, 2.5, 2.1, 1.9, 1.8], step_ms=20.0),  # best
        curve_record("dash", 4e-3, 1, [5.5, 2.5, 2.4, 2.35, 2.31], step_ms=20.0),  # never reaches 2.3
        curve_record("dash", 8e-3, 0, [5.5, 2.0, None, None, None]),  # diverged: never the best
    ]
    assert analysis.best_lr(records, "adamw", 8, 40) == 2e-3
    # Seed 0 is the only one run at every lr of dash: it decides (4e-3), the diverged 8e-3 never wins.
    assert analysis.best_lr(records, "dash", 8, 40) == 4e-3
    rows = {row["optimizer"]: row for row in analysis.summary_rows(records, 8, 40, ["adamw", "dash"])}
    assert rows["adamw"]["steps_to_adamw_final"] == [40, 40]
    assert rows["adamw"]["steps_ratio_to_adamw"] == [1.0, 1.0]
    assert rows["dash"]["steps_to_adamw_final"] == [20, None]
    assert rows["dash"]["steps_ratio_to_adamw"] == [0.5, None]
    assert rows["dash"]["wall_s_to_adamw_final"] == [2.0, None]
    assert rows["dash"]["estimated_s_to_adamw_final"] == [20 * 20.0 / 1e3, None]
    assert rows["dash"]["final_val_loss_mean"] == pytest.approx((1.8 + 2.31) / 2)
    transfer = analysis.lr_transfer(records, 8, 40, dash="dash")
    assert transfer["ratio"] == 2.0 and transfer["seeds"] == [0]
    assert transfer["lost"] == pytest.approx(1.9 - 1.8)
    # The grid is extended past an edge only when the best lr is there.
    assert peers.edge_extension(records, "adamw", 8, 40) == 4e-3
    assert peers.edge_extension(records, "dash", 8, 40) is None


@pytest.mark.parametrize("name", ["soap", "psgd-kron"])
def test_heavyball_contenders_train(tmp_path, name):
    pytest.importorskip("heavyball", reason="heavyball is not installed")
    check_trains(tmp_path, name, 1e-2)


def test_meta_shampoo_trains(tmp_path):
    pytest.importorskip("distributed_shampoo", reason="Meta's Distributed Shampoo is not installed")
    check_trains(tmp_path, "meta-shampoo", 1e-2, steps=12)  # its Shampoo roots start at step 10


def check_trains(tmp_path: Path, name: str, lr: float, steps: int = 6) -> None:
    tiny = list(TINY)
    tiny[tiny.index("--steps") + 1] = str(steps)
    peers.main([*tiny, "--out", str(tmp_path), "--optimizers", name, f"--lrs-{name}", str(lr)])
    (record,) = read(tmp_path / "peers_cpu.json")["records"]
    assert record["status"] == "ok" and record["state_bytes"] > 0
    assert record["final_val_loss"] < record["initial_val_loss"]


@pytest.mark.parametrize("name", ["meta-shampoo-dash-recipe", "muon-match-rms"])
def test_new_contenders_train_and_record_their_recipe(tmp_path, name):
    contender = contenders.CONTENDERS[name]
    if contender.requires is not None:
        pytest.importorskip(contender.requires, reason=f"{contender.requires} is not installed")
    check_trains(tmp_path, name, 1e-2)  # Meta's roots with DASH's recipe start at step 2
    (record,) = read(tmp_path / "peers_cpu.json")["records"]
    if name == "muon-match-rms":
        assert record["options"]["adjust_lr_fn"] == "match_rms_adamw"
        assert contender.lrs == contenders.ADAMW_LRS
        # A Muon that does not take the option makes the contender unavailable, not a crash.
        with pytest.raises(contenders.Unavailable):
            contenders.build_muon([torch.zeros(4, 4, requires_grad=True)], 1e-2, {"adjust_lr_fn": "no_such_rule"})
        return
    options = record["options"]
    assert {key: options[key] for key in ("root_order", "precondition_frequency", "nesterov")} == {
        "root_order": 2,
        "precondition_frequency": 2,
        "nesterov": True,
    }
    # Read back from the built optimizer: -1/2 on each factor of a matrix, no factor on vectors, and
    # beta3 = beta1**2 (DASH's Nesterov direction), roots from step 2.
    assert options["inverse_exponent_override"] == {"1": 0.0, "2": 0.5}
    assert options["beta3"] == pytest.approx(contenders.BETAS[0] ** 2)
    assert options["start_preconditioning_step"] == 2


def test_meta_shampoo_with_dash_recipe_is_dash_on_matrices():
    """Meta's Shampoo given DASH's recipe (square roots, Nesterov, roots every 2 steps) moves every
    matrix as DASH with those options does (same absolute damping, and DASH's roots from step 2, the
    first Meta takes); with Meta's exponent or momentum it does not, so the recipe really is applied."""
    pytest.importorskip("distributed_shampoo", reason="Meta's Distributed Shampoo is not installed")
    import _meta_shampoo

    from lightning_dash import DASH

    recipe = contenders.DASH_RECIPE
    assert (recipe.root_order, recipe.precondition_frequency, recipe.nesterov) == (2, 2, True)
    torch.manual_seed(0)
    # One block each (block 32), factors of full rank from the first refresh (step 2) on.
    shapes = [(24, 16), (30, 20), (16,)]
    initial = [torch.randn(shape) for shape in shapes]
    gradients = [[torch.randn(shape) for shape in shapes] for _ in range(6)]
    shared = {"lr": 0.01, "betas": contenders.BETAS, "block_size": 32}
    shared |= {"grafting_beta2": contenders.BETAS[1], "grafting_epsilon": 1e-8, "epsilon": 1e-6}
    frequency = recipe.precondition_frequency
    ours = [p.clone().requires_grad_() for p in initial]
    dash = DASH(
        ours,
        **shared,
        inverse_root_method="eigh",
        relative_epsilon=False,
        root_order=recipe.root_order,
        nesterov=recipe.nesterov,
        precondition_frequency=frequency,
        start_preconditioning_step=_meta_shampoo.start_preconditioning_step(frequency),
        grafting_norm="frobenius",  # Meta grafts Adam's Frobenius norm
        lr_scale=1.0,  # and steps it at the lr itself
    )
    runs = {
        "recipe": (recipe.root_order, recipe.nesterov),
        "fourth roots": (4, recipe.nesterov),
        "no Nesterov": (recipe.root_order, False),
    }
    moved = {}
    metas = {}
    for label, (root_order, nesterov) in runs.items():
        params = [p.clone().requires_grad_() for p in initial]
        metas[label] = (
            params,
            _meta_shampoo.build_meta_shampoo(
                params, **shared, precondition_frequency=frequency, root_order=root_order, nesterov=nesterov
            ),
        )
    for step_grads in gradients:
        for params, optimizer in [(ours, dash), *metas.values()]:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
    for label, (params, _) in metas.items():
        moved[label] = max(
            ((a - b).abs().max() / (a - start).abs().max()).item() for start, a, b in zip(initial[:2], ours, params)
        )
    assert moved["recipe"] <= 1e-4, moved
    assert moved["fourth roots"] > 3e-2 and moved["no Nesterov"] > 3e-2, moved

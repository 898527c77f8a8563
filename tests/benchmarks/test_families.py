"""The model-family suite (benchmarks/races/families.py) in miniature: two families, a few steps, one seed."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_dash import DashConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytest.importorskip("sklearn")


def load(name: str):
    """A benchmark script as a module (registered by name: the suite's worker processes import it)."""
    for folder in (BENCHMARKS, BENCHMARKS / "races"):  # the shared modules (family_models), the suite's folder
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return importlib.import_module(name)


@pytest.mark.multiprocess
def test_tiny_suite_trains_every_contender_and_summarises_against_tuned_adamw(tmp_path):
    families = load("families")
    records_path, out = tmp_path / "runs.jsonl", tmp_path / "summary.json"
    summary = families.main(
        ["--families", "mlp", "embedding", "--seeds", "0", "--workers", "1", "--max-steps", "6", "--extend-edges", "0"]
        + ["--records", str(records_path), "--out", str(out)]
    )
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    models = load("family_models")
    for family in ("mlp", "embedding"):
        adamw = [r for r in records if r["family"] == family and r["contender"] == "adamw"]
        # AdamW ran its whole grid; its best lr is the grid's argmin of the final validation loss.
        assert sorted(r["lr"] for r in adamw) == sorted(models.FAMILIES[family].adamw_lrs)
        best = min(adamw, key=lambda r: r["final_val"])
        for record in [r for r in records if r["family"] == family]:
            assert record["optimizer"] == ("AdamW" if record["contender"] == "adamw" else "DASH")
            assert record["curve"][-1][0] == 6 and math.isfinite(record["initial_val"])
            assert math.isfinite(record["final_train_loss"])
            assert record["diverged"] == (record["final_val"] is None or record["final_val"] > record["initial_val"])
        rows = {row["contender"]: row for row in summary["rows"] if row["family"] == family}
        assert set(rows) == {"adamw", *families.VARIANTS}
        assert rows["adamw"]["lr"] == best["lr"] and rows["adamw"]["final_val"] == best["final_val"]
        dash = next(r for r in records if r["family"] == family and r["contender"] == "dash")
        assert dash["lr"] == best["lr"]  # DASH runs the AdamW recipe at AdamW's best lr
        assert rows["dash"]["ratio_to_adamw"] == pytest.approx(dash["final_val"] / best["final_val"])
        assert dash["dash_config"] == {}  # DASH's own defaults: nothing changed
    version_04 = next(r for r in records if r["contender"] == "dash-v0.4")
    assert version_04["dash_config"]["lr_scale"] == "8.0"
    assert version_04["dash_group"]["epsilon"] == 1e-6 and version_04["dash_group"]["precondition_frequency"] == 2
    defaults = next(r for r in records if r["contender"] == "dash")["dash_group"]
    assert defaults["epsilon"] == DashConfig().epsilon
    assert defaults["precondition_frequency"] == DashConfig().precondition_frequency
    assert json.loads(out.read_text())["adamw_grids"]["mlp"] == sorted(models.FAMILIES["mlp"].adamw_lrs)


def test_timing_rows_give_the_roots_share_against_the_run_with_roots_computed_once():
    families = load("families")
    name, once_options = families.ROOTS_ONCE

    def record(contender: str, options: dict, repeat: int, train_s: float) -> dict:
        return {
            **{"family": "f", "contender": contender, "options": options, "repeat": repeat, "lr": 1e-3},
            **{"train_s": train_s, "step_ms_median": 10 * train_s, "final_val": 0.5},
            "curve": [(10, train_s / 2, 1.0), (20, train_s, 0.5)],
        }

    records = [
        record(contender, options, repeat, scale * train_s)
        for repeat, scale in enumerate((1.0, 1.5, 0.9))  # a busier and a quieter round: medians are taken
        for contender, options, train_s in (("adamw", {}, 2.0), ("dash", {}, 4.0), (name, once_options, 3.0))
    ]
    rows = {row["contender"]: row for row in families.timing_rows(records)}
    assert rows["dash"]["roots_share"] == pytest.approx(1 - 3.0 / 4.0)
    assert rows["adamw"]["roots_share"] is None and rows[name]["roots_share"] is None
    assert rows["dash"]["step_ratio"] == pytest.approx(2.0)


def test_the_wider_families_build_their_data_and_models_as_described():
    """The five later families: each takes a finite loss on its first batch; the denoising data
    corrupt about 15% of the bytes and add noise of standard deviation 0.3; the BERT classifier
    masks its padding (a sequence padded further gives the same logits, unlike the unmasked model)."""
    wider = load("family_models_wider")
    for name, family in wider.WIDER.items():
        batch = next(iter(family.train_loader(seed=0, steps=1)))
        assert math.isfinite(float(family.module(1e-3, seed=0).loss(batch))), name
    (corrupted, clean), _ = wider.corrupted_english()
    assert 0.12 < float((corrupted != clean).float().mean()) < 0.16  # 15%, less the draws of the same byte
    (noisy, images), _ = wider.noisy_digits()
    assert abs(float((noisy - images).std()) - 0.3) < 0.01
    classifier = wider.tiny_bert().eval()
    padded, shorter = torch.tensor([[5, 9, 13, 7, 0, 0]]), torch.tensor([[5, 9, 13, 7]])
    with torch.no_grad():
        torch.testing.assert_close(classifier(padded), classifier(shorter))
        unmasked = classifier.model(input_ids=padded).logits  # the same model reading its padding
        assert not torch.allclose(unmasked, classifier(shorter))

"""Checkpoints: standard layout, exact resume, copies not views, dtype and devices."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from lightning_dash import DASH


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 6 * 6, 40),
        torch.nn.ReLU(),
        torch.nn.LayerNorm(40),
        torch.nn.Linear(40, 3),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 3, 8, 8, generator=generator), torch.randn(16, 3, generator=generator)


def train(model, opt, steps, start=0, skip_bias_at=None):
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == skip_bias_at:
            model[2].bias.grad = None
        opt.step()


OPTIONS = dict(
    lr=0.01,
    block_size=32,
    precondition_frequency=3,
    inverse_root_method="newton_db",
    matrix_scaling="power_iteration",
    weight_decay=0.01,
)


@pytest.mark.parametrize("method", ["newton_db", "eigh", "coupled_newton", "chebyshev"])
def test_resume_equals_uninterrupted(method):
    options = {**OPTIONS, "inverse_root_method": method}
    straight = make_model()
    straight_opt = DASH(straight.parameters(), **options)
    train(straight, straight_opt, 8, skip_bias_at=2)

    first = make_model()
    first_opt = DASH(first.parameters(), **options)
    train(first, first_opt, 4, skip_bias_at=2)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    torch.manual_seed(1234)  # a different global random state must not matter
    resumed = make_model(seed=99)
    resumed.load_state_dict(saved["model"])
    resumed_opt = DASH(resumed.parameters(), **options)
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, 4, start=4)

    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_standard_and_complete():
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS)
    train(model, opt, 3)
    state = opt.state_dict()
    assert set(state) >= {"state", "param_groups"}
    params = list(model.parameters())
    assert sorted(state["state"]) == list(range(len(params)))
    assert state["param_groups"][0]["params"] == list(range(len(params)))
    conv = state["state"][0]  # (6, 27) with block 32: one tile
    assert conv["step"].item() == 3
    assert conv["momentum"].shape == params[0].shape
    assert conv["left_factor_0_0"].shape == (6, 6) and conv["right_root_0_0"].shape == (27, 27)
    linear = state["state"][2]  # (40, 216): 2 x 7 tiles
    assert {f"left_factor_{i}_{j}" for i in range(2) for j in range(7)} <= set(linear)
    assert linear["root_valid"].all()
    norm_weight = state["state"][4]
    assert set(norm_weight) == {"step", "momentum", "grafting_rms"}


def test_saved_tensors_are_copies_not_views():
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS)
    train(model, opt, 2)
    state = opt.state_dict()
    factor = state["state"][2]["left_factor_0_0"]
    assert factor.untyped_storage().nbytes() == factor.numel() * factor.element_size()
    before = factor.clone()
    train(model, opt, 1, start=2)
    assert torch.equal(factor, before)


def test_exported_state_matches_factor_definition():
    """left_factor times factor_scale is the EMA of G G^T of its tile, recomputed here
    from the gradients; the stored part never exceeds the tile's side in magnitude."""
    weight = torch.nn.Parameter(torch.zeros(5, 3))
    opt = DASH([weight], lr=0.0, betas=(0.9, 0.8), block_size=2)
    grads = [torch.randn(5, 3) for _ in range(3)]
    expected = torch.zeros(2, 2)
    for g in grads:
        weight.grad = g
        opt.step()
        tile = g[2:4, 0:2]
        expected = 0.8 * expected + 0.2 * tile @ tile.T
    state = opt.state_dict()["state"][0]
    assert state["left_factor_1_0"].abs().max() <= 2.0
    factor = state["left_factor_1_0"].double() * state["factor_scale_1_0"]
    torch.testing.assert_close(factor, expected.double(), rtol=1e-5, atol=1e-6)


def test_low_precision_parameters_keep_float32_statistics():
    weight = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = DASH([weight], block_size=4)
    weight.grad = torch.randn(8, 8, dtype=torch.bfloat16)
    opt.step()
    saved = opt.state_dict()
    fresh = DASH([weight], block_size=4)
    fresh.load_state_dict(saved)
    resaved = fresh.state_dict()["state"][0]
    assert resaved["left_factor_0_0"].dtype == torch.float32
    assert resaved["momentum"].dtype == torch.float32
    torch.testing.assert_close(resaved["left_factor_1_1"], saved["state"][0]["left_factor_1_1"])


def test_changed_block_size_is_a_clear_error():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    opt = DASH([weight], block_size=4)
    weight.grad = torch.randn(8, 8)
    opt.step()
    other = DASH([weight], block_size=8)
    with pytest.raises(ValueError, match="block_size=8"):
        other.load_state_dict(opt.state_dict())


def test_add_param_group_after_training_keeps_existing_state():
    first, second = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6, 6))
    opt = DASH([first], block_size=4, lr=0.01)
    for _ in range(2):
        first.grad = torch.randn(6, 6)
        opt.step()
    before = opt.state_dict()["state"][0]
    opt.add_param_group({"params": [second], "lr": 0.1})
    after = opt.state_dict()["state"][0]
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    first.grad, second.grad = torch.randn(6, 6), torch.randn(6, 6)
    opt.step()
    state = opt.state_dict()["state"]
    assert state[0]["step"].item() == 3 and state[1]["step"].item() == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_onto_another_device():
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS)
    train(model, opt, 3)
    saved = opt.state_dict()
    gpu_model = make_model().cuda()
    gpu_model.load_state_dict(model.state_dict())
    gpu_opt = DASH(gpu_model.parameters(), **OPTIONS)
    gpu_opt.load_state_dict(saved)
    x, y = batch(3)
    gpu_opt.zero_grad()
    torch.nn.functional.mse_loss(gpu_model(x.cuda()), y.cuda()).backward()
    gpu_opt.step()
    train(model, opt, 1, start=3)
    for a, b in zip(model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_records_its_step_shaping_options_and_a_resume_with_others_says_which():
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS, root_order=4, nesterov=False, lr_scale=2.0)
    train(model, opt, 2)
    saved = opt.state_dict()
    assert {k: saved["dash"][k] for k in ("root_order", "nesterov", "lr_scale")} == {
        "root_order": 4,
        "nesterov": False,
        "lr_scale": 2.0,
    }
    same = DASH(model.parameters(), **OPTIONS, root_order=4, nesterov=False, lr_scale=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved)
    other = DASH(model.parameters(), **OPTIONS, root_order=2, nesterov=False, lr_scale=1.0)
    with pytest.warns(UserWarning, match=r"trained with root_order=4, lr_scale=2\.0; .* root_order=2, lr_scale=1\.0"):
        other.load_state_dict(saved)
    assert other.root_order == 2 and other.lr_scale == 1.0  # this optimizer's options stay


def test_a_resume_under_other_step_options_says_so_also_for_checkpoints_that_did_not_record_them():
    """A checkpoint records the options that shape the step. One of version 0.6 (spectral grafting, roots
    from the start step every f, no record of root_schedule or eigh_dtype) resumed under today's defaults
    says which differ; one of 0.5, which recorded no grafting norm either, trained with Frobenius grafting;
    a resume with the checkpoint's values is silent."""
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS, grafting_norm="spectral", root_schedule="from_start")
    train(model, opt, 2)
    saved = opt.state_dict()
    assert (saved["dash"]["grafting_norm"], saved["dash"]["root_schedule"]) == ("spectral", "from_start")
    version_06 = {**saved, "dash": {k: v for k, v in saved["dash"].items() if k not in ("root_schedule", "eigh_dtype")}}
    for checkpoint in (saved, version_06):
        with pytest.warns(UserWarning, match=r"grafting_norm='spectral'.*root_schedule='from_start'.*continues with"):
            DASH(model.parameters(), **OPTIONS).load_state_dict(checkpoint)
        kept = DASH(model.parameters(), **OPTIONS, grafting_norm="spectral", root_schedule="from_start")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept.load_state_dict(checkpoint)
    version_05 = {**version_06, "dash": {k: v for k, v in version_06["dash"].items() if k != "grafting_norm"}}
    with pytest.warns(UserWarning, match=r"trained with grafting_norm='frobenius'.*grafting_norm='spectral'"):
        DASH(model.parameters(), **OPTIONS, grafting_norm="spectral", root_schedule="from_start").load_state_dict(
            version_05
        )


def test_a_version_04_checkpoint_names_the_options_that_keep_its_training():
    """0.4 wrote no root_order, nesterov or lr_scale (its conversions used lr_scale 8): a resume says so."""
    model = make_model()
    opt = DASH(model.parameters(), **OPTIONS)
    train(model, opt, 2)
    saved = opt.state_dict()
    for name in ("root_order", "nesterov", "lr_scale", "grafting_norm", "root_schedule", "eigh_dtype"):
        del saved["dash"][name]
    fresh = DASH(model.parameters(), **OPTIONS)
    with pytest.warns(UserWarning, match=r"0\.4 or older.*lr_scale=8\.0 if converted from Adam/AdamW"):
        fresh.load_state_dict(saved)

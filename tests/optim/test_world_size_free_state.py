"""DASH's world-size-free state (``sharded_state_dict``) in one process: what it holds,
that it and torch's layout resume the same run exactly, and the clear errors a
checkpoint of another model, block size or solver gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dash import DASH

OPTIONS = dict(lr=0.02, block_size=4, precondition_frequency=2, start_preconditioning_step=2)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def train(network: nn.Module, optimizer: DASH, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        ((network(x) - y) ** 2).mean().backward()
        optimizer.step()


def trained(steps: int = 3, **options) -> tuple[nn.Module, DASH]:
    network = model()
    optimizer = DASH(network.named_parameters(), **{**OPTIONS, **options})
    train(network, optimizer, range(steps))
    return network, optimizer


def test_the_state_is_keyed_by_name_and_tile():
    _, optimizer = trained()
    state = optimizer.sharded_state_dict()
    assert list(state["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    first = state["state"]["0.weight"]  # 9 x 6 at block_size 4: a 3 x 2 grid of tiles
    tiles = {key.rsplit("_", 2)[0] for key in first if key.count("_") >= 2}
    assert tiles == {
        "left_factor", "right_factor", "left_root", "right_root", "factor_scale",
        "momentum", "grafting_rms", "root_valid", "root_failures",
    }  # fmt: skip
    assert first["momentum_2_1"].shape == (1, 2) and first["left_factor_2_1"].shape == (1, 1)
    assert state["state"]["0.bias"]["momentum"].shape == (9,)
    assert state["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # the solver saved is the one in use: what "auto" picked on this device (eigh on the CPU)
    assert optimizer.inverse_root_method == "auto" and state["dash"]["inverse_root_method"] == "eigh"
    assert state["dash"]["block_size"] == 4
    # The tiles hold the same numbers as torch's layout (a parameter-shaped momentum).
    torch_layout = optimizer.state_dict()["state"][0]
    assert torch.equal(first["momentum_2_1"], torch_layout["momentum"][8:9, 4:6])
    assert torch.equal(first["right_root_1_0"], torch_layout["right_root_1_0"])


@pytest.mark.parametrize("form", ["sharded", "torch"])
def test_either_form_resumes_the_run_exactly(form):
    uninterrupted, optimizer = trained(6)
    network, saved = trained(3)
    state = saved.sharded_state_dict() if form == "sharded" else saved.state_dict()
    resumed = DASH(network.named_parameters(), **OPTIONS)
    resumed.load_state_dict(state)
    train(network, resumed, range(3, 6))
    for actual, expected in zip(network.parameters(), uninterrupted.parameters()):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"block_size": 8}, "block_size=4 and this optimizer has block_size=8"),
        ({"inverse_root_method": "coupled_newton"}, "inverse_root_method='eigh' and this optimizer has"),
    ],
)
def test_another_block_size_or_solver_is_named(change, message):
    _, saved = trained()
    network = model()
    other = DASH(network.named_parameters(), **{**OPTIONS, **change})
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(saved.sharded_state_dict())


def test_auto_takes_a_checkpoint_of_any_solver():
    _, saved = trained()
    state = saved.sharded_state_dict()
    state["dash"]["inverse_root_method"] = "newton_db"  # as written on a GPU, where auto picks newton_db
    resumed = DASH(model().named_parameters(), **OPTIONS)
    resumed.load_state_dict(state)  # roots are recomputed at the next refresh, with this device's solver
    assert resumed.inverse_root_method_in_use == "eigh"


def test_a_checkpoint_of_another_model_is_named():
    _, saved = trained()
    torch.manual_seed(0)
    other_network = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    renamed = [(f"encoder.{name}", param) for name, param in other_network.named_parameters()]
    other = DASH(renamed, **OPTIONS)
    with pytest.raises(ValueError, match="'0.weight' in the checkpoint and 'encoder.0.weight' here"):
        other.load_state_dict(saved.sharded_state_dict())


def test_a_scheduler_of_the_converted_optimizer_keeps_driving_dash_after_a_load():
    network, saved = trained()
    adamw = torch.optim.AdamW(network.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)  # stays on the AdamW
    dash = DASH.from_optimizer(adamw, block_size=4, precondition_frequency=2, start_preconditioning_step=2)
    dash.load_state_dict(saved.state_dict())
    assert dash.param_groups[0]["lr"] == OPTIONS["lr"]  # the checkpoint's
    scheduler.step()
    assert dash.param_groups[0]["lr"] == OPTIONS["lr"] * 0.5

"""The ``Dash`` Composer algorithm in one process: the swap, the schedule, checkpoints,
registration, monitoring and bad options. Runs in the Composer environment."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import pytest
import torch
from composer import Callback, State
from composer.callbacks import OptimizerMonitor
from composer.loggers import InMemoryLogger, Logger
from composer_runs import (
    BASE_LR,
    DASH_OPTIONS,
    RecordLearningRates,
    assert_matches_reference,
    build_model,
    make_trainer,
    named_parameters,
    reference_parameters,
    schedule_factor,
)
from helpers.option_values import NON_DEFAULT, assert_carries, user_optimizer
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_dash import DASH, DashConfig
from lightning_dash.composer import Dash, DashComposerMonitor, DashMonitor
from lightning_dash.optim.config import OPTION_NAMES


def parameters(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.state.model.parameters()]


@pytest.mark.parametrize("kind", ["gpt", "classifier"])
def test_dash_trains_with_the_composer_schedule(kind: str) -> None:
    lrs = RecordLearningRates()
    trainer = make_trainer(kind, "6ba", callbacks=[lrs])
    trainer.fit()
    assert isinstance(trainer.state.optimizers[0], DASH)
    # The Composer scheduler was compiled against DASH and drives its groups.
    assert trainer.state.schedulers[0].optimizer is trainer.state.optimizers[0]
    assert lrs.lrs == pytest.approx([BASE_LR * schedule_factor(b) for b in range(6)], rel=1e-12)
    # Independent expectation: DASH stepped by hand on the same batches and schedule.
    assert_matches_reference(named_parameters(trainer.state.model), reference_parameters(kind, 6), rtol=1e-5, atol=1e-6)
    trainer.close()


def test_the_algorithm_at_its_defaults_steps_as_dash_from_the_same_optimizer() -> None:
    """One lr meaning: ``Dash()`` with no options takes the steps of ``DASH.from_optimizer`` on the
    same ``DecoupledAdamW`` (which the Lightning lane's tests/trainers/test_lr_rule.py ties to plain ``DASH``
    at the same lr, and to the Lightning and Fabric strategies)."""
    trainer = make_trainer("gpt", "6ba", algorithm_options={})
    trainer.fit()
    expected = reference_parameters("gpt", 6, options={}, attach_model=True)
    assert_matches_reference(named_parameters(trainer.state.model), expected, rtol=1e-5, atol=1e-6)
    trainer.close()


def test_resume_from_a_composer_checkpoint_continues_exactly(tmp_path: Path) -> None:
    uninterrupted = make_trainer("gpt", "8ba", save_folder=tmp_path / "full")
    uninterrupted.fit()
    expected = parameters(uninterrupted)
    expected_state = uninterrupted.state.optimizers[0].state_dict()
    uninterrupted.close()

    first = make_trainer("gpt", "8ba", save_folder=tmp_path / "first")
    first.fit(duration="4ba")
    first.close()
    resumed = make_trainer("gpt", "8ba", load_path=str(tmp_path / "first" / "ep0-ba4-rank0.pt"))
    assert resumed.state.timestamp.batch.value == 4
    resumed.fit()
    for ours, theirs in zip(parameters(resumed), expected):
        assert torch.equal(ours, theirs)
    state = resumed.state.optimizers[0].state_dict()["state"]
    for key, entry in expected_state["state"].items():
        for name, value in entry.items():
            assert torch.equal(state[key][name], value), (key, name)
    resumed.close()


def test_autoresume_picks_up_the_latest_checkpoint(tmp_path: Path) -> None:
    reference = make_trainer("classifier", "8ba")
    reference.fit()
    expected = parameters(reference)
    reference.close()

    folder = tmp_path / "checkpoints"
    interrupted = make_trainer("classifier", "5ba", save_folder=folder, run_name="auto", autoresume=True)
    interrupted.fit()
    interrupted.close()
    resumed = make_trainer("classifier", "8ba", save_folder=folder, run_name="auto", autoresume=True)
    assert resumed.state.timestamp.batch.value == 5  # Composer also saves when a run ends
    resumed.fit()
    for ours, theirs in zip(parameters(resumed), expected):
        assert torch.equal(ours, theirs)
    resumed.close()


def test_distributed_checkpoint_api_on_a_fresh_dash_changes_nothing() -> None:
    """``get_optimizer_state_dict`` runs a zero-gradient, zero-lr step on an optimizer
    without state; DASH must come out of it as if untouched."""
    model = build_model("gpt")
    touched = DASH(model.parameters(), lr=0.01, **DASH_OPTIONS)
    before = [p.detach().clone() for p in model.parameters()]
    saved = get_optimizer_state_dict(model, touched)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(entry["step"]) == 0 for entry in saved["state"].values())
    assert all(p.grad is None for p in model.parameters())

    twin = build_model("gpt")
    untouched = DASH(twin.parameters(), lr=0.01, **DASH_OPTIONS)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (4, 24), generator=generator)
    batch = (tokens, torch.randint(0, 256, (4, 24), generator=generator))
    for _ in range(3):
        for net, optimizer in ((model, touched), (twin, untouched)):
            optimizer.zero_grad()
            net.loss(net(batch), batch).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_distributed_checkpoint_round_trip_restores_every_statistic() -> None:
    model = build_model("gpt")
    optimizer = DASH(model.parameters(), lr=0.01, **DASH_OPTIONS)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 24), generator=generator)
        batch = (tokens, torch.roll(tokens, -1, dims=1))
        optimizer.zero_grad()
        model.loss(model(batch), batch).backward()
        optimizer.step()
    saved = get_optimizer_state_dict(model, optimizer)

    fresh_model = build_model("gpt")
    fresh_model.load_state_dict(model.state_dict())
    fresh = DASH(fresh_model.parameters(), lr=0.01, **DASH_OPTIONS)
    set_optimizer_state_dict(fresh_model, fresh, saved)
    again = get_optimizer_state_dict(fresh_model, fresh)
    assert again["state"].keys() == saved["state"].keys()
    for name, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(again["state"][name][key]), torch.as_tensor(value)), (name, key)


def declared_entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points pyproject.toml declares (what the next install registers)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["entry-points"]
    return {name: importlib.metadata.EntryPoint(name, value, group) for name, value in declared[group].items()}


def test_entry_points_resolve_to_dash_and_its_monitor() -> None:
    assert declared_entry_points("llmfoundry_algorithms")["dash"].load() is Dash
    assert declared_entry_points("llmfoundry_callbacks")["dash_monitor"].load() is DashComposerMonitor
    # llm-foundry builds algorithms from YAML keyword arguments.
    algorithm = Dash(block_size=512, matmul_dtype="bfloat16", grafting="sgd")
    assert dict(algorithm.conversion.overrides) == {"block_size": 512, "matmul_dtype": "bfloat16", "grafting": "sgd"}


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_every_dash_option_by_keyword_or_config_reaches_the_converted_optimizer(name: str) -> None:
    for algorithm in (Dash(**{name: NON_DEFAULT[name]}), Dash(DashConfig(**{name: NON_DEFAULT[name]}))):
        assert dict(algorithm.conversion.overrides) == {name: NON_DEFAULT[name]}
        assert_carries(algorithm.conversion.convert(user_optimizer()), name, NON_DEFAULT[name])


def test_trainer_converts_with_every_option_keywords_winning_over_config() -> None:
    from composer import Trainer
    from composer.optim import DecoupledAdamW

    model = build_model("classifier")
    params = list(model.parameters())
    optimizer = DecoupledAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.01)
    config = DashConfig(block_size=64, grafting_beta2=0.5, max_consecutive_root_failures=None)
    keywords = {name: value for name, value in NON_DEFAULT.items() if name != "grafting_beta2"}
    trainer = Trainer(
        model=model, optimizers=optimizer, algorithms=[Dash(config, **keywords)], device="cpu", progress_bar=False
    )
    converted = trainer.state.optimizers[0]
    assert isinstance(converted, DASH)
    for name, value in NON_DEFAULT.items():
        assert_carries(converted, name, value)
    assert "block_size=7" in repr(trainer.state.algorithms[0])
    trainer.close()


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"inverse_root_method": "svd"}, ValueError, "inverse_root_method"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"matmul_dtype": "int8"}, ValueError, "matmul_dtype"),
        ({"communication_dtype": "float64"}, ValueError, "communication_dtype"),
        ({"precondition_frequency": 1.5}, ValueError, "precondition_frequency"),
        ({"chebyshev_degree": 1}, ValueError, "chebyshev_degree"),
        ({"shampoo_blend": 2.0}, ValueError, "shampoo_blend"),
        ({"bias_correction": "no"}, TypeError, "bias_correction"),
        ({"factor_decay": -0.5}, ValueError, "factor_decay"),
        ({"config": {"block_size": 8}}, TypeError, "config"),
    ],
)
def test_bad_options_name_the_argument(options: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        Dash(**options)


def test_a_micro_group_budget_without_fsdp2_is_refused_at_init() -> None:
    with pytest.raises(ValueError, match="micro_group_mib applies where parameters are sharded"):
        make_trainer("classifier", "1ba", algorithm_options={**DASH_OPTIONS, "micro_group_mib": 64})


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(TypeError, match="blocksize"):
        Dash(blocksize=3)


def test_an_unconvertible_optimizer_fails_at_init() -> None:
    model = build_model("classifier")
    from composer import Trainer

    with pytest.raises(ValueError, match="amsgrad"):
        Trainer(
            model=model,
            optimizers=torch.optim.Adam(model.parameters(), amsgrad=True),
            algorithms=[Dash()],
            device="cpu",
            progress_bar=False,
        )


class RecordGradientNorms(Callback):
    """The global gradient norm once backward is complete, before the optimizer step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def after_train_batch(self, state: State, logger: Logger) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        self.norms.append(math.sqrt(sum(float(g.norm()) ** 2 for g in grads)))


def test_monitors_log_through_composer() -> None:
    memory = InMemoryLogger()
    norms = RecordGradientNorms()
    trainer = make_trainer(
        "gpt",
        "4ba",
        callbacks=[norms, DashComposerMonitor(logging_interval=2), OptimizerMonitor(batch_log_interval=1)],
        loggers=[memory],
    )
    trainer.fit()
    step_ms = memory.data["dash/optimizer_step_ms"]
    assert [timestamp.batch.value for timestamp, _ in step_ms] == [2, 4]
    assert all(value > 0 for _, value in step_ms)
    assert [value for _, value in memory.data["dash/root_failures"]] == [0.0, 0.0]
    assert [value for _, value in memory.data["dash/ownership_balance"]] == [1.0, 1.0]
    # OptimizerMonitor still works: it reports the gradients the step used, every batch.
    logged = [value for _, value in memory.data["l2_norm/grad/global"]]
    assert logged == pytest.approx(norms.norms, rel=1e-5)
    assert all(norm > 0 for norm in logged)
    trainer.close()


def test_the_former_names_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="DashComposerMonitor"):
        monitor = DashMonitor(logging_interval=3)
    assert isinstance(monitor, DashComposerMonitor) and monitor.logging_interval == 3
    with pytest.warns(DeprecationWarning, match="log_interval"):
        assert DashComposerMonitor(log_interval=5).logging_interval == 5
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="logging_interval"):
        DashComposerMonitor(logging_interval=2, log_interval=5)
    with pytest.raises(ValueError, match="logging_interval"):
        DashComposerMonitor(logging_interval=0)


def test_monitor_without_dash_is_a_clear_error() -> None:
    model = build_model("classifier")
    from composer import Trainer

    trainer = Trainer(
        model=model,
        callbacks=[DashComposerMonitor()],
        device="cpu",
        progress_bar=False,
        train_dataloader=torch.utils.data.DataLoader([(torch.zeros(16, dtype=torch.long), 0)] * 2),
        max_duration="1ba",
    )
    with pytest.raises(TypeError, match="DashComposerMonitor needs DASH"):
        trainer.fit()


def test_the_algorithm_tells_dash_the_model_for_hidden_routing() -> None:
    from composer import Trainer
    from composer.optim import DecoupledAdamW

    from lightning_dash.showcase.composer_models import ComposerTinyGPT

    torch.manual_seed(0)
    model = ComposerTinyGPT(context=8, width=16, depth=1, heads=2)
    embedding = model.model.token.weight.detach().clone()
    tokens = torch.randint(0, 256, (8, 9))
    loader = torch.utils.data.DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=4)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=DecoupledAdamW(model.parameters(), lr=0.01),
        algorithms=[Dash(block_size=16, precondition="hidden", split_rows={"in_proj_weight": 3})],
        max_duration="2ba",
        device="cpu",
        progress_bar=False,
    )
    trainer.fit()
    views = trainer.state.optimizers[0].preconditioning()
    assert views["model.token.weight"] is None and views["model.head.weight"] is None
    assert views["model.blocks.layers.0.self_attn.in_proj_weight"].parts == 3
    assert not torch.equal(model.model.token.weight, embedding)  # grafting moved it
    trainer.close()

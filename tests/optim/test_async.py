"""Asynchronous preconditioning (``async_preconditioning=True``, ``max_staleness=k``).

On CPU the option is the synchronous path, bit for bit. The staleness bookkeeping is
tested on CPU through the pipeline's deterministic emulation (``roots.pipeline.emulate``:
roots computed at launch, swapped in at the deadline), against the float64 reference
with the same root delay. The CUDA tests (marked ``cuda``) compare the side-stream runs
with that emulation and with the reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.reference import ReferenceDash
from helpers.spawning import START_METHOD
from torch import nn

from lightning_dash import DASH, DashStrategy
from lightning_dash.optim.roots import RootResult, inverse_root

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_model(seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3)).to(device)


def batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=generator).to(device), torch.randn(8, 3, generator=generator).to(device)


def train(model, opt, steps, start=0, skip_bias_at=None, save_at=None, device="cpu"):
    """Plain training; ``save_at``: after that many steps, ``state_dict()`` is serialised
    (as a checkpoint would be: its ``step`` entries are the live counters) and returned."""
    saved = None
    for step in range(start, start + steps):
        x, y = batch(step, device)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == skip_bias_at:
            model[2].bias.grad = None
        opt.step()
        if save_at is not None and step + 1 == save_at:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            saved = torch.load(buffer)
    return saved


# Roots at the start step and every f steps (not the default "doubling", whose extra early refreshes the
# protocol tests below would have to count): the step numbers they name follow from that.
OPTIONS = dict(
    lr=0.02, block_size=8, epsilon=1e-4, weight_decay=0.01, inverse_root_method="newton_db", root_schedule="from_start"
)


def dash(model, emulate=False, **options):
    opt = DASH(model.parameters(), **{**OPTIONS, **options})
    opt.roots.pipeline.emulate = emulate
    return opt


def preconditioned(opt) -> tuple[int, int]:
    """(blocks whose roots are in use, blocks), read without settling anything."""
    return opt.preconditioned_blocks, opt.owned_blocks


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(async_preconditioning=1), "async_preconditioning"),
        (dict(async_preconditioning="yes"), "async_preconditioning"),
        (dict(max_staleness=0), "max_staleness"),
        (dict(max_staleness=1.5), "max_staleness"),
        (dict(max_staleness=True), "max_staleness"),
        (dict(max_staleness="2"), "max_staleness"),
    ],
)
def test_invalid_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DASH(make_model().parameters(), **kwargs)
    with pytest.raises(ValueError, match=name):
        DashStrategy(**kwargs)


def test_strategy_passes_the_options_to_dash():
    strategy = DashStrategy(async_preconditioning=True, max_staleness=3)
    converted = strategy.conversion.convert(torch.optim.AdamW(make_model().parameters()))
    assert converted.async_preconditioning is True and converted.max_staleness == 3
    assert "async_preconditioning" not in DashStrategy().conversion.overrides


# --------------------------------------------------------------------------- CPU: synchronous
@pytest.mark.parametrize("frequency,staleness", [(1, 1), (3, 2)])
def test_option_on_cpu_is_bit_identical_to_synchronous(frequency, staleness):
    plain, on = make_model(), make_model()
    plain_opt = dash(plain, precondition_frequency=frequency)
    on_opt = dash(on, precondition_frequency=frequency, async_preconditioning=True, max_staleness=staleness)
    train(plain, plain_opt, 7, skip_bias_at=2)
    train(on, on_opt, 7, skip_bias_at=2)
    for a, b in zip(plain.parameters(), on.parameters()):
        assert torch.equal(a, b)
    assert not on_opt.roots.pipeline.pending and on_opt.roots.pipeline.clock == 0
    assert (on_opt.async_roots_hidden, on_opt.async_roots_waited, on_opt.async_wait_ms) == (0, 0, 0.0)
    saved_plain, saved_on = plain_opt.state_dict(), on_opt.state_dict()
    for key, entry in saved_plain["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, saved_on["state"][key][name]), (key, name)


# --------------------------------------------------------------------------- staleness semantics
def run_against_reference(staleness, frequency, steps=7, emulate=True, device="cpu"):
    """DASH (float32, eigh roots) and the float64 reference with ``root_delay=staleness``
    (and without delay) on the same gradients; swaps happen at the deadline."""
    shapes = [(12, 8), (7, 5), (8,)]
    generator = torch.Generator().manual_seed(11)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(steps)]
    options = dict(lr=0.01, epsilon=0.1, weight_decay=0.1, precondition_frequency=frequency)
    params = [nn.Parameter(x.float().to(device)) for x in initial]
    opt = DASH(
        params, block_size=4, inverse_root_method="eigh", async_preconditioning=True, max_staleness=staleness, **options
    )
    opt.roots.pipeline.emulate = emulate
    opt.roots.pipeline.swap_when_ready = False
    delayed = ReferenceDash(block_size=4, root_delay=staleness, **options)
    immediate = ReferenceDash(block_size=4, **options)
    expected = [x.clone() for x in initial]
    undelayed = [x.clone() for x in initial]
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.float().to(device)
        opt.step()
        delayed.step(expected, step_grads)
        immediate.step(undelayed, step_grads)
    return [p.detach().double().cpu() for p in params], expected, undelayed


@pytest.mark.parametrize("staleness,frequency", [(1, 1), (2, 1), (1, 3), (2, 3), (3, 3), (4, 3)])
def test_emulated_staleness_matches_the_delayed_float64_reference(staleness, frequency):
    params, expected, undelayed = run_against_reference(staleness, frequency)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param, reference, rtol=1e-4, atol=1e-5)
    # The delay is visible: the synchronous reference is clearly elsewhere.
    assert max((p - u).abs().max().item() for p, u in zip(params, undelayed)) > 1e-3


def test_bookkeeping_swaps_at_the_deadline_and_counts_failures_there():
    """Frequency 3, staleness 2: roots launched at step 1 are used from step 3 on; a failed
    root is counted at step 3 (the deadline, the same step on every rank), not at step 1."""
    real = inverse_root
    calls = {"count": 0}

    def first_call_fails(statistics, eps, settings, scale=None, min_eps=None):
        calls["count"] += 1
        result = real(statistics, eps, settings, scale, min_eps)
        if calls["count"] == 1:
            broken = result.root.clone()
            broken[0] = math.nan
            return RootResult(broken, result.residual)
        return result

    model = make_model()
    opt = dash(model, emulate=True, precondition_frequency=3, async_preconditioning=True, max_staleness=2)
    opt.roots.solver = first_call_fails
    train(model, opt, 1)
    solver_calls = calls["count"]  # one per factor size, all at the launch
    pipeline = opt.roots.pipeline
    assert pipeline.pending and pipeline.pending_deadline == 3
    assert preconditioned(opt)[0] == 0 and opt.last_root_residual is None
    train(model, opt, 1, start=1)
    assert pipeline.pending and preconditioned(opt)[0] == 0 and opt.root_failure_count == 0
    train(model, opt, 1, start=2)  # the deadline: swapped in at the start of the step, then closed
    assert not pipeline.pending
    assert opt.preconditioned_blocks == opt.owned_blocks - 1  # the failed block keeps no root
    assert opt.root_failure_count == 1 and opt.last_root_residual is not None
    assert (opt.async_roots_hidden, opt.async_roots_waited) == (1, 0)
    train(model, opt, 1, start=3)  # step 4: the next launch
    assert pipeline.pending and pipeline.pending_deadline == 6
    assert calls["count"] == 2 * solver_calls


def test_new_roots_due_swap_the_pending_launch_first():
    """Staleness 3 at frequency 1: each launch is swapped in at the very next step."""
    model = make_model()
    opt = dash(model, emulate=True, precondition_frequency=1, async_preconditioning=True, max_staleness=3)
    train(model, opt, 1)
    assert opt.roots.pipeline.pending_deadline == 4 and preconditioned(opt)[0] == 0
    train(model, opt, 1, start=1)
    assert opt.preconditioned_blocks == opt.owned_blocks and opt.roots.pipeline.pending_deadline == 5


# --------------------------------------------------------------------------- stream protocol
class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.number))


class FakeEvent:
    def __init__(self, number: int, log: list, timing: bool) -> None:
        self.number, self.log, self.timing = number, log, timing
        self.ready = timing  # timing events complete at once; launch events when a test says so

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record_event", stream.name, self.number))

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        self.ready = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 5.0


class FakeCudaOps:
    """Streams and events as log entries, so the CUDA code path runs (in order) on a CPU."""

    def __init__(self) -> None:
        self.log: list = []
        self.main = FakeStream("main", self.log)
        self.current = self.main
        self.events: list[FakeEvent] = []

    def handles(self, device):
        return True

    def current_stream(self, device):
        return self.main

    def new_stream(self, device):
        return FakeStream("side", self.log)

    @contextlib.contextmanager
    def use_stream(self, stream):
        self.current = stream
        try:
            yield
        finally:
            self.current = self.main

    def new_event(self, timing=False):
        event = FakeEvent(len(self.events), self.log, timing)
        self.events.append(event)
        return event

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name, id(tensor)))


def test_stream_protocol_with_fake_cuda():
    """The side-stream code path, run on a CPU with logged streams and events: the solver
    runs on the side stream after it waited for the main stream; snapshots and outputs are
    marked for the stream that reads them; nothing is installed before the main stream
    waited on the launch's event; a launch that is not ready leaves the previous roots."""
    ops = FakeCudaOps()
    real = inverse_root

    def solver(statistics, eps, settings, scale=None, min_eps=None):
        ops.log.append(("solve", ops.current.name))
        return real(statistics, eps, settings, scale, min_eps)

    model = make_model()
    opt = dash(model, precondition_frequency=4, async_preconditioning=True, max_staleness=3)
    opt.roots.solver = solver
    opt.roots.pipeline.ops = ops
    install = opt.roots.install

    def logged_install(job, solved):
        ops.log.append(("install", ops.current.name))
        return install(job, solved)

    opt.roots.install = logged_install

    train(model, opt, 1)  # step 1: launch
    launch_log = list(ops.log)
    solves = [entry for entry in launch_log if entry[0] == "solve"]
    assert launch_log[0] == ("wait_stream", "side", "main") and solves
    assert all(stream == "side" for _, stream in solves)
    assert launch_log[len(solves) + 1] == ("record_event", "side", 0)
    snapshots = [entry for entry in launch_log if entry[0] == "record_stream"]
    # each solve reads three snapshots: the factors, their damping and their scales
    assert len(snapshots) == len(solves) * 3 and all(entry[1] == "side" for entry in snapshots)

    train(model, opt, 1, start=1)  # step 2: the event is not ready; nothing is used
    assert not any(entry[0] in ("install", "wait_event") for entry in ops.log)
    assert preconditioned(opt)[0] == 0

    ops.events[0].ready = True
    ops.log.clear()
    train(model, opt, 1, start=2)  # step 3: ready, swapped in without waiting
    install_at = ops.log.index(("install", "main"))
    assert ops.log[0] == ("wait_event", "main", 0)
    outputs = [entry for entry in ops.log[:install_at] if entry[0] == "record_stream"]
    assert len(outputs) == len(solves) * 2 and all(entry[1] == "main" for entry in outputs)  # roots, residuals
    assert opt.preconditioned_blocks == opt.owned_blocks and (opt.async_roots_hidden, opt.async_roots_waited) == (1, 0)

    # The same schedule as the emulation that swaps at step 3 (staleness 2).
    emulated = make_model()
    train(
        emulated, dash(emulated, emulate=True, precondition_frequency=4, async_preconditioning=True, max_staleness=2), 3
    )
    for a, b in zip(model.parameters(), emulated.parameters()):
        assert torch.equal(a, b)

    train(model, opt, 5, start=3)  # step 5 launches; 6 and 7 find it busy; 8 is its deadline
    assert opt.async_roots_waited == 1 and opt.async_wait_ms == 5.0
    stall = [entry for entry in ops.log if entry[0] in ("record_event", "wait_event") and entry[1] == "main"]
    launch_event = ops.events[1].number
    assert stall[-3:] == [
        ("record_event", "main", launch_event + 1),
        ("wait_event", "main", launch_event),
        ("record_event", "main", launch_event + 2),
    ]


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("staleness,frequency", [(2, 3), (3, 4)])
def test_checkpoint_with_pending_work_resumes_exactly(staleness, frequency):
    """state_dict() swaps the pending launch in; the run that saved and the resumed run agree."""
    options = dict(precondition_frequency=frequency, async_preconditioning=True, max_staleness=staleness)
    saving = make_model()
    saving_opt = dash(saving, emulate=True, **options)
    saved = train(saving, saving_opt, 8, skip_bias_at=4, save_at=2)
    assert all(saved["state"][0]["root_valid"].flatten())  # the launch of step 1 is in the file

    resumed = make_model()
    train(resumed, dash(resumed, emulate=True, **options), 2)  # same model state at step 2
    resumed_opt = dash(resumed, emulate=True, **options)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, 6, start=2, skip_bias_at=4)
    for a, b in zip(saving.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    # Saving is part of the trajectory: it swaps in at step 2 what an unsaved run swaps in
    # at the deadline. With the deadline at step 3 that is the same; later, it is not.
    unsaved = make_model()
    train(unsaved, dash(unsaved, emulate=True, **options), 8, skip_bias_at=4)
    same = all(torch.equal(a, b) for a, b in zip(saving.parameters(), unsaved.parameters()))
    assert same == (staleness == 2)


def test_load_discards_and_add_param_group_settles_pending_work():
    model = make_model()
    opt = dash(model, emulate=True, precondition_frequency=4, async_preconditioning=True, max_staleness=3)
    snapshot = opt.state_dict()  # empty state
    train(model, opt, 1)
    assert opt.roots.pipeline.pending
    opt.load_state_dict(snapshot)
    assert not opt.roots.pipeline.pending

    train(model, opt, 1, start=1)
    assert opt.roots.pipeline.pending
    extra = nn.Parameter(torch.randn(4, 4))
    before = extra.detach().clone()
    opt.add_param_group({"params": [extra]})  # rebuilds the stacks: pending roots go in first
    assert not opt.roots.pipeline.pending
    assert all(opt.state_dict()["state"][0]["root_valid"].flatten())
    x, y = batch(2)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    extra.grad = torch.randn(4, 4)
    opt.step()
    assert opt.roots.pipeline.pending  # the new parameter's first roots
    assert torch.isfinite(extra).all() and not torch.equal(extra, before)


# --------------------------------------------------------------------------- Lightning, AMP, compile
class SmallModule(pl.LightningModule):
    def __init__(self, compile_net: bool = False, **dash_options) -> None:
        super().__init__()
        self.net = make_model()
        if compile_net:
            # Inductor needs ~25 s to compile on this 2-core CPU; aot_eager traces the same
            # graphs through Dynamo and AOTAutograd in well under a second.
            self.net = torch.compile(self.net, backend="aot_eager")
        self.dash_options = {**OPTIONS, "precondition_frequency": 2, **dash_options}

    def training_step(self, data, batch_idx):
        x, y = batch(batch_idx)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return DASH(self.parameters(), **self.dash_options)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(8))


def lightning_run(tmp_path, **options) -> list[torch.Tensor]:
    module = SmallModule(**options)
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(module)
    return [p.detach().clone() for p in module.parameters()]


def test_bf16_mixed_accumulation_and_compile_on_cpu_equal_the_option_off(tmp_path):
    off = lightning_run(tmp_path, compile_net=True)
    on = lightning_run(tmp_path, compile_net=True, async_preconditioning=True, max_staleness=2)
    assert all(torch.equal(a, b) for a, b in zip(off, on))


# --------------------------------------------------------------------------- two processes
def two_process_run(tmp_path, name: str, emulate: bool = False, **options) -> list[torch.Tensor]:
    from helpers.lightning_parity import DASH_OPTIONS, release_process_group, trainer

    run = trainer(2, 3, tmp_path, strategy=DashStrategy(start_method=START_METHOD, **{**DASH_OPTIONS, **options}))
    path = tmp_path / f"{name}.pt"
    run.fit(FinalParameters(str(path), emulate))
    release_process_group()
    return torch.load(path)


@pytest.mark.multiprocess
def test_two_processes_with_the_option_equal_the_option_off(tmp_path):
    """Real gloo ranks with block ownership: the option leaves CPU training bit-identical."""
    off = two_process_run(tmp_path, "off")
    on = two_process_run(tmp_path, "on", async_preconditioning=True, max_staleness=2)
    assert all(torch.equal(a, b) for a, b in zip(off, on))


@pytest.mark.multiprocess
def test_two_processes_emulated_staleness_keeps_ranks_in_step(tmp_path):
    """Emulated asynchronous roots with ownership (each rank launches its own blocks; the
    failure count is a collective at the closing steps): ranks stay bit-identical and
    equal one process with the same staleness."""
    from helpers.lightning_parity import (
        DASH_OPTIONS,
        adamw_with_schedule,
        assert_matches_reference,
        global_batch,
        network,
    )

    sharded = two_process_run(tmp_path, "emulated", emulate=True, async_preconditioning=True, max_staleness=2)
    model = network()
    optimizer, _ = adamw_with_schedule(model.parameters())
    single = DASH.from_optimizer(optimizer, **DASH_OPTIONS, async_preconditioning=True, max_staleness=2)
    single.roots.pipeline.emulate = True
    for step in range(3):
        x, y = global_batch(step)
        single.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        single.step()
    for a, b, start in zip(sharded, model.parameters(), network().parameters()):
        assert_matches_reference(a, b.detach(), start.detach())


class FinalParameters(pl.LightningModule):
    """The parity set-up of test_strategy (constant lr): ranks are compared after every
    step, and rank 0 saves its final parameters."""

    def __init__(self, path: str, emulate: bool = False) -> None:
        super().__init__()
        from helpers.lightning_parity import network

        self.net = network()
        self.path = path
        self.emulate = emulate

    def training_step(self, data, batch_idx):
        from helpers.lightning_parity import global_batch

        x, y = global_batch(self.trainer.global_step)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return nn.functional.mse_loss(self.net(x[rank::world]), y[rank::world])

    def configure_optimizers(self):
        from helpers.lightning_parity import adamw_with_schedule

        optimizer, _ = adamw_with_schedule(self.parameters())
        return optimizer

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(4))

    def on_train_start(self):
        self.trainer.optimizers[0].roots.pipeline.emulate = self.emulate

    def on_train_batch_end(self, outputs, data, batch_idx):
        from helpers.lightning_parity import assert_identical_across_ranks

        assert_identical_across_ranks(self, self.trainer.world_size)

    def on_train_end(self):
        optimizer = self.trainer.optimizers[0]
        assert optimizer.distributor.world_size == 2
        if self.emulate:
            assert optimizer.async_roots_hidden > 0
        if self.trainer.global_rank == 0:
            torch.save([p.detach().clone() for p in self.parameters()], self.path)


# --------------------------------------------------------------------------- benchmark
def test_benchmark_smoke_run_writes_the_record_layout(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "speed" / "async_overlap.py"
    spec = importlib.util.spec_from_file_location("async_overlap", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_overlap"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("async_overlap", None)
    output = tmp_path / "async_overlap_cpu.json"
    module.main(["--smoke", "--device", "cpu", "--output", str(output)])
    records = json.loads(output.read_text())
    assert [(r["optimizer"], r["precondition_frequency"]) for r in records] == [
        ("adamw", None),
        ("dash_sync", 1),
        ("dash_async", 1),
        ("dash_sync", 10),
        ("dash_async", 10),
    ]
    for record in records:
        assert set(record) == {"device", "optimizer", "precondition_frequency", "step_ms"}
        assert record["device"] == "cpu" and record["step_ms"] > 0


# --------------------------------------------------------------------------- CUDA
def cuda_run(steps=6, emulate=False, device="cuda", **options):
    model = make_model(device=device)
    opt = dash(model, emulate=emulate, async_preconditioning=True, **options)
    train(model, opt, steps, skip_bias_at=2, device=device)
    return model, opt


def assert_same_parameters(first, second, exact=False):
    for a, b in zip(first.parameters(), second.parameters()):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("staleness,frequency", [(1, 1), (2, 3), (3, 4)])
def test_cuda_side_stream_equals_the_emulation_with_the_same_staleness(staleness, frequency):
    """Swaps forced to the deadline (swap_when_ready=False) equal the emulation; with
    staleness 1 the schedule is deterministic anyway (the deadline is the next step)."""
    options = dict(max_staleness=staleness, precondition_frequency=frequency)
    emulated, _ = cuda_run(emulate=True, **options)
    model = make_model(device="cuda")
    opt = dash(model, async_preconditioning=True, **options)
    opt.roots.pipeline.swap_when_ready = False
    train(model, opt, 6, skip_bias_at=2, device="cuda")
    assert_same_parameters(model, emulated)
    assert opt.async_roots_hidden + opt.async_roots_waited > 0


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("staleness,frequency", [(1, 1), (2, 3)])
def test_cuda_matches_the_delayed_float64_reference(staleness, frequency):
    params, expected, _ = run_against_reference(staleness, frequency, emulate=False, device="cuda")
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@CUDA
def test_cuda_roots_are_not_used_before_their_event():
    """A side-stream event held back by a long sleep after the solver: the main stream keeps
    the previous roots (frequency 4, staleness 3: steps 2 and 3 run while the launch of step 1
    has not signalled) and waits at the deadline; the result equals the emulation, which swaps
    at the deadline. (A sleep before the solver would stall the host, not only the stream:
    see ``RootPipeline.before_event``.)"""
    options = dict(max_staleness=3, precondition_frequency=4)
    emulated, _ = cuda_run(steps=5, emulate=True, **options)
    model = make_model(device="cuda")
    opt = dash(model, async_preconditioning=True, **options)
    opt.roots.pipeline.before_event = lambda: torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles
    train(model, opt, 5, skip_bias_at=2, device="cuda")
    torch.cuda.synchronize()
    assert_same_parameters(model, emulated)
    # Launched at step 1, not ready at steps 2 and 3 (the host ran ahead), waited for at 4.
    assert (opt.async_roots_hidden, opt.async_roots_waited) == (0, 1) and opt.async_wait_ms > 0.0


@pytest.mark.cuda
@CUDA
def test_cuda_ready_events_swap_at_the_next_step():
    """With the device idle between steps every event is ready at the next step: the run
    equals the emulation with staleness 1, whatever max_staleness allows."""
    emulated, _ = cuda_run(emulate=True, max_staleness=1, precondition_frequency=3)
    model = make_model(device="cuda")
    opt = dash(model, async_preconditioning=True, max_staleness=3, precondition_frequency=3)
    for step in range(6):
        train(model, opt, 1, start=step, skip_bias_at=2, device="cuda")
        torch.cuda.synchronize()
    assert_same_parameters(model, emulated)
    assert opt.async_roots_hidden == 2 and opt.async_roots_waited == 0


@pytest.mark.cuda
@CUDA
def test_cuda_checkpoint_with_pending_work_resumes_exactly():
    options = dict(precondition_frequency=4, max_staleness=3)
    saving = make_model(device="cuda")
    saving_opt = dash(saving, async_preconditioning=True, **options)
    saving_opt.roots.pipeline.swap_when_ready = False
    saved = train(saving, saving_opt, 8, skip_bias_at=4, save_at=2, device="cuda")
    resumed = make_model(device="cuda")
    warm = dash(resumed, async_preconditioning=True, **options)
    warm.roots.pipeline.swap_when_ready = False
    train(resumed, warm, 2, device="cuda")
    resumed_opt = dash(resumed, async_preconditioning=True, **options)
    resumed_opt.roots.pipeline.swap_when_ready = False
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, 6, start=2, skip_bias_at=4, device="cuda")
    assert_same_parameters(saving, resumed, exact=True)


@pytest.mark.cuda
@CUDA
def test_cuda_bf16_autocast_accumulation_and_compile_equal_the_emulation():
    def run(emulate: bool) -> nn.Module:
        model = make_model(device="cuda")
        compiled = torch.compile(model)
        opt = dash(model, emulate=emulate, async_preconditioning=True, max_staleness=1, precondition_frequency=1)
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(2 * step + micro, "cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(compiled(x).float(), y) / 2
                loss.backward()
            opt.step()
        return model

    assert_same_parameters(run(emulate=False), run(emulate=True))

"""Shared set-up of the Composer tests: data, models, trainers and a plain-PyTorch
reference that applies DASH to the same global batches without Composer.

Used in-process by the single-process tests and by ``launch_train.py`` under
Composer's launcher for the two-process tests.
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
from composer import Callback, State, Trainer
from composer.loggers import InMemoryLogger, Logger
from composer.models import ComposerModel
from composer.optim import DecoupledAdamW, LinearScheduler
from composer.utils import FSDP2Config, dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_dash import DASH
from lightning_dash.composer import Dash, DashComposerMonitor
from lightning_dash.distributed import ProcessGroupDistributor
from lightning_dash.integration.sharded_checkpoint import name_parameters
from lightning_dash.showcase import load_stdlib_corpus
from lightning_dash.showcase.composer_models import ComposerTinyGPT, last_target, next_byte_classifier
from lightning_dash.showcase.stdlib_text import RandomWindows

CONTEXT = {"gpt": 24, "classifier": 16}
GLOBAL_BATCH = 16
TOTAL_BATCHES = 8
BASE_LR = 1e-2
#: The parity checks compare ranks with one process within 1e-4 of each parameter's movement; their
#: numerics are pinned to fourth roots and plain momentum (the distribution code does not depend on
#: them), as in test_strategy's PARITY_NUMERICS, and to one routing: the algorithm knows the model and
#: the default routing would leave its embeddings and output layer to Adam, while the single-process
#: references here are built without a model.
DASH_OPTIONS = {
    "precondition": "all_matrices",
    "block_size": 16,
    "precondition_frequency": 2,
    "epsilon": 1e-4,
    "root_order": 4,
    "nesterov": False,
    "lr_scale": 1.0,
}
#: Grafting whose step is proportional to the gradient's scale: a gradient world-size times
#: the mean (gloo's sum where FSDP2 asks for an average) shows in the parameters.
SGD_GRAFTING_OPTIONS = {**DASH_OPTIONS, "grafting": "sgd"}


def windows(kind: str) -> Dataset:
    corpus = load_stdlib_corpus(max_bytes=200_000)
    return RandomWindows(corpus.train, CONTEXT[kind], GLOBAL_BATCH * TOTAL_BATCHES, seed=0)


def collate(kind: str):
    return last_target if kind == "classifier" else None


def build_model(kind: str) -> ComposerModel:
    torch.manual_seed(0)
    if kind == "gpt":
        return ComposerTinyGPT(context=CONTEXT["gpt"], width=32, depth=1, heads=2)
    return next_byte_classifier(context=CONTEXT["classifier"], embedding=8, hidden=48)


def schedule_factor(batch: int) -> float:
    """The learning-rate factor of batch ``batch`` under ``LinearScheduler(1, 0.1, t_max=8ba)``.

    Composer steps its schedulers after each batch but before advancing the
    timestamp, so batch ``b`` runs with the schedule's value at time ``b - 1``.
    """
    elapsed = max(batch - 1, 0)
    return 1.0 + (0.1 - 1.0) * min(1.0, elapsed / TOTAL_BATCHES)


class RecordLearningRates(Callback):
    """Remembers the learning rate each batch's optimizer step used."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self.lrs.append(state.optimizers[0].param_groups[0]["lr"])


def make_trainer(
    kind: str,
    max_duration: str,
    save_folder: Path | None = None,
    run_name: str = "dash",
    load_path: str | None = None,
    autoresume: bool = False,
    algorithm_options: dict[str, Any] | None = None,
    callbacks: list[Callback] | None = None,
    loggers: list[Any] | None = None,
    fsdp: str | None = None,
    parallelism: dict[str, Any] | None = None,
    extra_parameter: bool = False,
) -> Trainer:
    """A Composer trainer of ``kind`` with Dash; ``fsdp``: FSDP2 with this
    ``state_dict_type`` ("sharded" or "full"), else DDP (or one process), unless
    ``parallelism`` gives Composer's ``parallelism_config``. ``extra_parameter``: the
    ComposerModel holds a parameter ``extra`` itself, outside its child modules."""
    model = build_model(kind)
    if extra_parameter:
        model.extra = torch.nn.Parameter(torch.zeros(4, 4))
    if fsdp is not None:
        parallelism = {"fsdp": FSDP2Config(state_dict_type=fsdp)}
    data = windows(kind)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    loader = DataLoader(
        data, batch_size=per_rank, sampler=dist.get_sampler(data, shuffle=False), collate_fn=collate(kind)
    )
    optimizer = DecoupledAdamW(model.parameters(), lr=BASE_LR, betas=(0.9, 0.99), weight_decay=1e-4)
    return Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=optimizer,
        schedulers=LinearScheduler(alpha_i=1.0, alpha_f=0.1, t_max=f"{TOTAL_BATCHES}ba"),
        algorithms=[Dash(**(algorithm_options if algorithm_options is not None else DASH_OPTIONS))],
        callbacks=callbacks or [],
        loggers=loggers or [],
        max_duration=max_duration,
        device="cpu",
        run_name=run_name,
        save_folder=None if save_folder is None else str(save_folder),
        save_interval="2ba",
        save_overwrite=not autoresume,
        save_num_checkpoints_to_keep=-1,
        load_path=load_path,
        autoresume=autoresume,
        parallelism_config=parallelism,
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )


def _without_key_third(name: str, value: torch.Tensor) -> torch.Tensor:
    """The key third of an attention in-projection bias has an exactly zero gradient in
    exact arithmetic (softmax ignores a constant added to every score of a query), so its
    gradient is rounding noise that Adam-style grafting normalises into full steps: only
    its query and value thirds are compared."""
    if not name.endswith("in_proj_bias"):
        return value
    third = value.numel() // 3
    return torch.cat([value[:third], value[2 * third :]])


def assert_matches_reference(
    ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    """Compare parameters by name, elementwise (runs whose arithmetic is the same up to
    the order of a few sums)."""
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        torch.testing.assert_close(
            _without_key_third(name, value),
            _without_key_third(name, expected[name]),
            rtol=rtol,
            atol=atol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def assert_tracks_reference(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], kind: str) -> None:
    """Two ranks sum gradients in another order than one process (a 1e-7 relative
    difference); DASH keeps that at roundoff: every parameter within 1e-4 of its movement
    from the initial model."""
    start = named_parameters(build_model(kind))
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        value, reference = _without_key_third(name, value), _without_key_third(name, expected[name])
        moved = (reference - _without_key_third(name, start[name])).norm()
        assert (value - reference).norm() <= 1e-4 * moved + 1e-7, name


def named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached whole copies (FSDP2's shards gathered: collective), named without DDP's ``module.`` prefix."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def reference_optimizer(
    kind: str, batches: int, options: dict[str, Any] | None = None, attach_model: bool = False
) -> tuple[DASH, dict[str, torch.Tensor]]:
    """DASH without Composer: the same initial model, converted from the same
    ``DecoupledAdamW`` (with ``options``, default :data:`DASH_OPTIONS`; told the model, as the
    algorithm tells it, with ``attach_model``), its parameters named as the algorithm names
    them under FSDP2, stepped on each global batch with the closed-form schedule. Returns
    the optimizer and the final parameters."""
    model = build_model(kind)
    data = windows(kind)
    optimizer = DASH.from_optimizer(
        DecoupledAdamW(model.parameters(), lr=BASE_LR, betas=(0.9, 0.99), weight_decay=1e-4),
        **(DASH_OPTIONS if options is None else options),
    )
    name_parameters(optimizer, model)
    if attach_model:
        optimizer.attach_model(model)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=False, collate_fn=collate(kind))
    for step, batch in zip(range(batches), loader):
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * schedule_factor(step)
        optimizer.zero_grad()
        model.loss(model(batch), batch).backward()
        optimizer.step()
    return optimizer, named_parameters(model)


def reference_parameters(
    kind: str, batches: int, options: dict[str, Any] | None = None, attach_model: bool = False
) -> dict[str, torch.Tensor]:
    """The final parameters of :func:`reference_optimizer`."""
    return reference_optimizer(kind, batches, options, attach_model)[1]


class RecordingDistributor(ProcessGroupDistributor):
    """The default distributor, remembering the owner of every block it assigned."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: list[int] = []

    def assign_owners(
        self, keys: Sequence[Hashable], shapes: Sequence[tuple[int, int]], frequencies: Sequence[int]
    ) -> list[int]:
        self.owners = super().assign_owners(keys, shapes, frequencies)
        return self.owners


def main() -> None:
    """Entry point under ``composer -n 2``: train, then save what each rank ended with."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("gpt", "classifier"), required=True)
    parser.add_argument("--max-duration", required=True)
    parser.add_argument("--save-folder", type=Path, required=True)
    parser.add_argument("--run-name", default="dash")
    parser.add_argument("--autoresume", action="store_true")
    parser.add_argument("--load-path")
    parser.add_argument("--fsdp", choices=("sharded", "full"))
    parser.add_argument("--grafting", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--micro-group-mib", type=float)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    lrs = RecordLearningRates()
    memory = InMemoryLogger()
    options = DASH_OPTIONS if args.grafting == "adam" else SGD_GRAFTING_OPTIONS
    if args.micro_group_mib is not None:
        options = {**options, "micro_group_mib": args.micro_group_mib}
    trainer = make_trainer(
        args.kind,
        args.max_duration,
        args.save_folder,
        args.run_name,
        load_path=args.load_path,
        autoresume=args.autoresume,
        algorithm_options=options,
        callbacks=[lrs, DashComposerMonitor()],
        loggers=[memory],
        fsdp=args.fsdp,
    )
    optimizer = trainer.state.optimizers[0]
    if args.fsdp is None and optimizer.distributor is not None:
        optimizer.distributor = RecordingDistributor()  # the one Dash installed, made to record the block owners
    trainer.fit()
    rank = dist.get_global_rank()
    owners = getattr(optimizer.distributor, "owners", [])
    torch.save(
        {
            "optimizer": type(optimizer).__name__,
            "distributor": type(optimizer.distributor).__name__,
            "world_size": optimizer.distributor.world_size if optimizer.distributor is not None else 1,
            "owners": owners,
            "owned_blocks": owners.count(rank),
            "owned_tiles": optimizer.owned_tiles(),
            "state_bytes": optimizer.state_bytes(),
            "ownership_balance": optimizer.ownership_balance,
            "batches": trainer.state.timestamp.batch.value,
            "lrs": lrs.lrs,
            "metrics": {name: values[-1][1] for name, values in memory.data.items() if name.startswith("dash/")},
            "parameters": named_parameters(trainer.state.model),
        },
        args.out / f"rank{rank}.pt",
    )
    trainer.close()


if __name__ == "__main__":
    main()

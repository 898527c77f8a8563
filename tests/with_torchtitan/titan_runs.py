"""torchtitan's Llama debug model, parallelised by torchtitan's own functions on gloo CPU ranks and
stepped by DASH through :class:`~lightning_dash.torchtitan.DashOptimizersContainer` on seeded
gradients, as one process would step it; and the same saved and resumed by torchtitan's own
checkpoint manager."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.optimizer import ParamGroupConfig

from lightning_dash.torchtitan import DashOptimizersContainer

#: DASH's options for every DASH group: small blocks, so that a 256-wide model has many, and the
#: float64 reference solver.
DASH_OPTIONS = {"block_size": 128, "inverse_root_method": "eigh", "precondition_frequency": 2}
#: AdamW's recipe, as torchtitan's ``default_adamw`` writes it.
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def seeded(name: str, shape: torch.Size, salt: str, scale: float) -> torch.Tensor:
    """A tensor drawn from a generator seeded by ``name`` and ``salt``: the same in every process."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{salt}".encode()))
    return torch.randn(shape, generator=generator) * scale


def debug_model(tensor_parallel: int) -> nn.Module:
    """torchtitan's ``llama3_debugmodel`` (its configuration filled as its trainer fills it, so that
    tensor parallelism knows each layer's sharding), with seeded weights."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.tensor_parallel_degree = tensor_parallel
    config.parallelism.spmd_backend = "partial_dtensor"
    config.model_spec.model.update_from_config(config=config)
    model = config.model_spec.model.build()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(seeded(name, param.shape, "weight", 0.02) + (1.0 if param.dim() == 1 else 0.0))
    return model


def parallelise(model: nn.Module, world_size: int, tensor_parallel: int) -> nn.Module:
    """The model as torchtitan's trainer parallelises it: FSDP2 over ``world_size / tensor_parallel``
    ranks, tensor parallelism over ``tensor_parallel`` (``parallelize_llama``), on the CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" where no accelerator is found
    shard = world_size // tensor_parallel
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", tensor_parallel_degree=tensor_parallel, data_parallel_shard_degree=shard
    )
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=shard,
        cp=1,
        tp=tensor_parallel,
        pp=1,
        ep=1,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    return parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(Path("/tmp")),
    )


def container(model: nn.Module, **options) -> DashOptimizersContainer:
    """The DASH container over ``model``: every parameter in one DASH group with AdamW's recipe."""
    config = DashOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DASH", optimizer_kwargs=dict(ADAMW))],
        optimizer_factory_kwargs_by_name={"DASH": {**DASH_OPTIONS, **options}},
    )
    return config.build(model_parts=[model])


def step(model: nn.Module, optimizers: DashOptimizersContainer, number: int) -> None:
    """One step on the seeded gradients of step ``number``, each laid out as its parameter."""
    for name, param in model.named_parameters():
        full = seeded(name, param.shape, f"grad {number}", 1e-2)
        param.grad = (
            distribute_tensor(full, param.device_mesh, param.placements) if isinstance(param, DTensor) else full
        )
    optimizers.step()
    optimizers.zero_grad()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }


def one_process(steps: int) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` steps of one process on the whole model."""
    model = debug_model(1)
    optimizers = container(model)
    for number in range(steps):
        step(model, optimizers, number)
    return full_parameters(model)


def checkpointer(model: nn.Module, optimizers: DashOptimizersContainer, folder: Path):
    """torchtitan's own checkpoint manager over the model, the container and a constant lr schedule."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    schedulers = LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None).build(
        optimizers=optimizers, training_steps=100
    )
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False)
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=str(folder),
    )


def train(
    rank: int,
    world_size: int,
    tensor_parallel: int,
    steps: range,
    out: Path,
    folder: Path,
    save_at: int | None = None,
) -> None:
    """Steps ``steps`` on the parallelised model, first resuming from torchtitan's checkpoint in
    ``folder`` at the first step's number if it is not 0, saving one at ``save_at``; rank 0 writes
    the final whole parameters to ``out``."""
    model = parallelise(debug_model(tensor_parallel), world_size, tensor_parallel)
    optimizers = container(model)
    manager = checkpointer(model, optimizers, folder)
    if steps.start > 0:
        assert manager.load(step=steps.start)
    for number in steps:
        step(model, optimizers, number)
        if save_at is not None and number + 1 == save_at:
            assert manager.save(curr_step=save_at)
    manager.close()
    parameters = full_parameters(model)
    if rank == 0:
        torch.save(parameters, out)
    dist.barrier()

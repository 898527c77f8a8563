"""Every entry point refuses a bad value of each of its own options when constructed, naming the option.

One table per entry point (``DashStrategy``, ``DashFSDPStrategy``, the two Fabric strategies, Composer's
``Dash``, ``DASH``, ``ShardedDistributor``) of the options it takes beyond DashConfig's, each tried with the
bad values of :data:`BAD`; a fuzz over DashConfig's options through ``DASH`` (construct, then one step) lets
only a ``ValueError`` or ``TypeError`` naming the option out. No process is started.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dash import DASH, DashFSDPStrategy, DashStrategy
from lightning_dash.distributed.sharded import ShardedDistributor
from lightning_dash.fabric import DashFabricFSDPStrategy, DashFabricStrategy
from lightning_dash.integration.fsdp_sharding import mesh_sizes
from lightning_dash.optim.config import OPTION_NAMES

#: Bad values by kind: zero, negative, float, string, bool, None (each option's table picks its own).
COUNT = [0, -1, 2.5, "2", True, None]  # an integer >= 1
FRACTION = [-0.5, 1.5, "0.9", True, math.nan]  # a number in [0, 1)
DTYPE = ["int8", torch.int8, 0, None, True]
MIB = [0, -1, "64", True, math.inf, math.nan]
CONVERSION: dict[str, list[Any]] = {
    "config": [{"block_size": 8}, 3, "config", True],
    "factor_decay": FRACTION,
    "allow_custom_step": [1, "yes", 0.5],
    "communication_dtype": DTYPE,
}
SHARDED: dict[str, list[Any]] = {
    **CONVERSION,
    "micro_group_mib": MIB,
    "shard_modules": [3, "Block", [3], [nn.Linear(2, 2)], True],
    "start_method": [None, 3, "forkserver", "thread"],
    "tensor_parallel_size": [*COUNT, "auto2"],
    "data_parallel_size": [*COUNT, "auto2"],
}


def _composer_dash(**options: Any) -> Any:
    """Composer's ``Dash`` algorithm (skipped where Composer is not installed)."""
    return pytest.importorskip("lightning_dash.composer").Dash(**options)


#: Each entry point's constructor, given one keyword, and the options it takes beyond DashConfig's.
ENTRY_POINTS: dict[str, tuple[Callable[..., Any], dict[str, list[Any]]]] = {
    "DashStrategy": (
        DashStrategy,
        {
            **CONVERSION,
            "micro_group_mib": MIB,  # also refused under DDP, by name
            "gradient_sync": [0, "all_reduce", None, True],
            "demo_topk": COUNT,
            "demo_chunk_size": COUNT,
            "demo_momentum": [-0.1, 1.0, "0.9", None, True],
            "start_method": [3, "forkserver"],
        },
    ),
    "DashFSDPStrategy": (DashFSDPStrategy, SHARDED),
    "DashFabricStrategy": (
        DashFabricStrategy,
        {**CONVERSION, "micro_group_mib": MIB, "start_method": [3, "forkserver"]},
    ),
    "DashFabricFSDPStrategy": (DashFabricFSDPStrategy, {**SHARDED, "parallelize_fn": [3, "shard", True]}),
    "Dash (Composer)": (_composer_dash, {**CONVERSION, "micro_group_mib": MIB}),
    "DASH": (
        lambda **option: DASH(**{"params": [nn.Parameter(torch.ones(2, 2))], **option}),
        {"params": [3, [3], "weights"], "config": CONVERSION["config"], "distributor": [3, "gloo", True]},
    ),
    "DASH(model=)": (
        lambda **option: DASH(nn.Linear(2, 2).parameters(), **option),
        {"model": [3, "model", True]},
    ),
    "ShardedDistributor": (
        ShardedDistributor,
        {
            "process_group": [3, "gloo", True],
            "communication_dtype": DTYPE,
            "root_iterations": COUNT,
            "micro_group_mib": MIB,
        },
    ),
}

#: What the mesh check and the strategies say for 3 on 4 processes.
NOT_A_DIVISOR = r"tensor_parallel_size=3 does not divide the 4 processes: give one of \[1, 2, 4\]"

CASES = [
    pytest.param(make, name, value, id=f"{entry}-{name}={value!r}")
    for entry, (make, options) in ENTRY_POINTS.items()
    for name, values in options.items()
    for value in values
]


@pytest.mark.parametrize("make,name,value", CASES)
def test_a_bad_option_is_refused_at_construction_by_name(make: Callable[..., Any], name: str, value: Any) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(name)):
        make(**{name: value})


def test_composer_dash_lists_everything_it_takes_for_an_unknown_option() -> None:
    with pytest.raises(TypeError, match=r"\['tensor_parallel_size'\].*'communication_dtype'.*'micro_group_mib'"):
        _composer_dash(tensor_parallel_size=2)


@pytest.mark.parametrize(
    "make",
    [
        lambda **option: DASH([nn.Parameter(torch.ones(2, 2))], **option),
        DashStrategy,
        DashFSDPStrategy,
        DashFabricStrategy,
        DashFabricFSDPStrategy,
    ],
    ids=["DASH", "DashStrategy", "DashFSDPStrategy", "DashFabricStrategy", "DashFabricFSDPStrategy"],
)
def test_a_misspelled_option_gets_the_closest_name_and_the_full_list(make: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match=r"'block_sise'\]?; did you mean 'block_size'\?.*'max_staleness'"):
        make(block_sise=8)


def test_one_misspelled_dash_option_reads_as_one() -> None:
    with pytest.raises(TypeError, match=r"^unknown DASH option 'block_sise'; did you mean 'block_size'\? \(known: \["):
        DASH([nn.Parameter(torch.ones(2, 2))], block_sise=8)


@pytest.mark.parametrize(
    "sizes,nodes,processes,expected",
    [
        (("auto", 1), 1, 4, (4, 1)),
        (("auto", 2), 1, 4, (2, 2)),
        (("auto", "auto"), 2, 4, (2, 4)),
        ((2, 2), 1, 4, (2, 2)),
        (("auto", 3), 2, 3, (2, 3)),
    ],
)
def test_mesh_sizes_that_fit_the_processes(sizes: tuple, nodes: int, processes: int, expected: tuple) -> None:
    assert mesh_sizes(*sizes, nodes, processes) == expected


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_names_the_divisors() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 does not divide the 4 processes: give one of \[1, 2, 4\]"
    ):
        mesh_sizes("auto", 3, 1, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the 6 processes.*\[1, 2, 3, 6\]"):
        mesh_sizes("auto", 4, 2, 3)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 times tensor_parallel_size=2 .* data_parallel_size=2"):
        mesh_sizes(3, 2, 1, 4)


@pytest.mark.parametrize(
    "build",
    [
        lambda: L.Trainer(accelerator="cpu", devices=4, strategy=DashFSDPStrategy(tensor_parallel_size=3)),
        lambda: L.Fabric(accelerator="cpu", devices=4, strategy=DashFabricFSDPStrategy(tensor_parallel_size=3)),
    ],
    ids=["Trainer", "Fabric"],
)
def test_the_trainer_refuses_a_tensor_parallel_size_that_does_not_divide_its_devices(build: Callable) -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 does not divide the 4 processes: give one of \[1, 2, 4\]"
    ):
        build()


#: Values tried for every DashConfig option (most are wrong for most options; a valid one must train).
FUZZ: list[Any] = [0, -1, 2.5, 10**9, "2", "auto", True, False, None, math.nan, math.inf, (), (1,), {"x": 1}, object()]
#: Valid values too slow to step here: compiling on the first step.
SLOW = {"compile": True}


def _step(name: str, value: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 3), nn.Linear(3, 5))
    optimizer = DASH(model.parameters(), model=model, **{name: value})
    model(torch.tensor([[1, 2, 3]])).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_fuzzing_an_option_lets_out_only_errors_that_name_it(name: str) -> None:
    for value in FUZZ:
        if name in SLOW and value is SLOW[name]:
            continue
        try:
            _step(name, value)
        except (ValueError, TypeError) as error:
            assert name in str(error), f"{name}={value!r}: {type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001 - the point: nothing else may come out
            pytest.fail(f"{name}={value!r} raised {type(error).__name__}: {error}")

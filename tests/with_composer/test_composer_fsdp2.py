"""``Dash`` under Composer's FSDP2: two processes with gloo on CPU (torch 2.7).

Each launch runs ``composer_runs.py`` under Composer's launcher with
``parallelism_config={"fsdp": FSDP2Config(state_dict_type=...)}``. The runs use SGD
grafting, whose step is proportional to the gradient: gloo under torch 2.7 sums where
FSDP2's reduce-scatter asks for an average, and a gradient twice the global-batch mean
would move the parameters twice as far as one process does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from composer.utils import FSDPConfig
from composer_runs import (
    SGD_GRAFTING_OPTIONS,
    TOTAL_BATCHES,
    assert_tracks_reference,
    make_trainer,
    named_parameters,
    reference_optimizer,
)
from test_composer_distributed import assert_same_on_both_ranks, launch

KIND = "gpt"


def train(tmp_path: Path, name: str, batches: int, *options: str, processes: int = 2) -> list[dict]:
    """A run of ``batches`` batches with SGD grafting, checkpointing every 2 into ``name``/checkpoints."""
    args = ["--kind", KIND, "--grafting", "sgd", "--max-duration", f"{batches}ba"]
    return launch(tmp_path, name, *args, "--save-folder", str(tmp_path / name / "checkpoints"), *options, n=processes)


def assert_equal_parameters(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], int, dict[str, list]]:
    """One process on the global batches: parameters, state bytes and every block's tile, by name."""
    optimizer, parameters = reference_optimizer(KIND, TOTAL_BATCHES, SGD_GRAFTING_OPTIONS, attach_model=True)
    return parameters, optimizer.state_bytes(), optimizer.owned_tiles()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Two ranks under FSDP2 for the whole run, writing sharded checkpoints."""
    tmp_path = tmp_path_factory.mktemp("fsdp2")
    return tmp_path, train(tmp_path, "sharded", TOTAL_BATCHES, "--fsdp", "sharded")


def tile_sets(tiles: dict[str, list]) -> dict[str, set]:
    return {name: {tuple(tile) for tile in value} for name, value in tiles.items()}


@pytest.mark.multiprocess
def test_fsdp2_matches_one_process_and_splits_the_state(sharded_run, reference) -> None:
    _, ranks = sharded_run
    parameters, one_process_bytes, one_process_tiles = reference
    for rank in ranks:
        assert rank["distributor"] == "ShardedDistributor" and rank["world_size"] == 2
        assert rank["batches"] == TOTAL_BATCHES
    assert_same_on_both_ranks(ranks)
    # The gradients are the global-batch mean (gloo's sum is corrected): the same run as one process.
    assert_tracks_reference(ranks[0]["parameters"], parameters, KIND)
    # Every block is owned by exactly one rank, and together they own a single process's blocks.
    owned = [tile_sets(rank["owned_tiles"]) for rank in ranks]
    expected = tile_sets(one_process_tiles)
    for name, tiles in expected.items():
        mine, theirs = owned[0].get(name, set()), owned[1].get(name, set())
        assert not mine & theirs and mine | theirs == tiles, name
    # The state is split: together the ranks hold what one process holds, each about half of it.
    assert sum(rank["state_bytes"] for rank in ranks) == one_process_bytes
    assert all(rank["state_bytes"] <= 0.6 * one_process_bytes for rank in ranks)


@pytest.mark.multiprocess
def test_the_monitor_logs_fsdp2_traffic_and_state_bytes(sharded_run) -> None:
    _, ranks = sharded_run
    for rank in ranks:
        metrics = rank["metrics"]
        assert metrics["dash/state_bytes"] == rank["state_bytes"]
        assert metrics["dash/grad_sync_bytes_sent_per_step"] > 0
        assert metrics["dash/optimizer_bytes_sent_per_step"] > 0


@pytest.mark.multiprocess
def test_sharded_checkpoints_resume_at_two_ranks_in_micro_groups_and_at_one(sharded_run, reference) -> None:
    tmp_path, uninterrupted = sharded_run
    checkpoint = str(tmp_path / "sharded" / "checkpoints" / "ep0-ba4")
    # Resumed with the blocks exchanged in micro-groups of one float32 16 x 16 block per rank (2 KiB).
    budget = ["--micro-group-mib", "0.004"]
    resumed = train(tmp_path, "resumed", TOTAL_BATCHES, "--fsdp", "sharded", "--load-path", checkpoint, *budget)
    assert len(resumed[0]["lrs"]) == TOTAL_BATCHES - 4
    assert all(rank["metrics"]["dash/micro_groups"] > 2 for rank in resumed)
    assert all(rank["metrics"]["dash/peak_gathered_bytes"] <= 0.004 * 2**20 for rank in resumed)
    # Stacks of other sizes round differently (float32): equal to roundoff, not bit for bit.
    for name, value in resumed[0]["parameters"].items():
        expected = uninterrupted[0]["parameters"][name]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7, msg=name)
    # One process reads the same folder (Composer needs the FSDP2 config to read it).
    alone = make_trainer(
        KIND, f"{TOTAL_BATCHES}ba", load_path=checkpoint, algorithm_options=SGD_GRAFTING_OPTIONS, fsdp="sharded"
    )
    assert alone.state.timestamp.batch.value == 4
    alone.fit()
    assert_tracks_reference(named_parameters(alone.state.model), reference[0], KIND)
    alone.close()


@pytest.mark.multiprocess
def test_single_file_checkpoints_cross_between_ddp_and_fsdp2(sharded_run, reference, tmp_path: Path) -> None:
    _, uninterrupted = sharded_run
    first_fsdp2 = train(tmp_path, "fsdp2_first", 4, "--fsdp", "full")
    assert first_fsdp2[0]["batches"] == 4
    fsdp2_file = str(tmp_path / "fsdp2_first" / "checkpoints" / "ep0-ba4-rank0.pt")
    # FSDP2 -> FSDP2 through one file (rank 0 gathered every block): the uninterrupted run, bit for bit.
    again = train(tmp_path, "fsdp2_again", TOTAL_BATCHES, "--fsdp", "full", "--load-path", fsdp2_file)
    assert_equal_parameters(again[0]["parameters"], uninterrupted[0]["parameters"])
    # FSDP2 -> DDP.
    ddp = train(tmp_path, "to_ddp", TOTAL_BATCHES, "--load-path", fsdp2_file)
    assert ddp[0]["distributor"] == "RecordingDistributor" and len(ddp[0]["lrs"]) == TOTAL_BATCHES - 4
    assert_tracks_reference(ddp[0]["parameters"], reference[0], KIND)
    # DDP -> FSDP2: the file holds whole momenta where FSDP2 keeps them per block.
    train(tmp_path, "ddp_first", 4)
    ddp_file = str(tmp_path / "ddp_first" / "checkpoints" / "ep0-ba4-rank0.pt")
    from_ddp = train(tmp_path, "from_ddp", TOTAL_BATCHES, "--fsdp", "full", "--load-path", ddp_file)
    assert len(from_ddp[0]["lrs"]) == TOTAL_BATCHES - 4
    for name, value in from_ddp[0]["parameters"].items():
        torch.testing.assert_close(value, uninterrupted[0]["parameters"][name], rtol=1e-6, atol=1e-9)


def test_fsdp1_is_refused_before_composer_asks_for_a_gpu() -> None:
    with pytest.raises(ValueError, match=r"Dash does not support FSDP1 .* use FSDP2"):
        make_trainer(KIND, "2ba", parallelism={"fsdp": FSDPConfig()})
    # The dict form is FSDP1 unless FSDP_VERSION=2.
    with pytest.raises(ValueError, match=r"Dash does not support FSDP1"):
        make_trainer(KIND, "2ba", parallelism={"fsdp": {"state_dict_type": "sharded"}})


def test_a_parameter_composer_leaves_whole_is_named() -> None:
    with pytest.raises(ValueError, match=r"Dash under FSDP2: extra is not sharded .* move it into a child"):
        make_trainer(KIND, "2ba", fsdp="sharded", extra_parameter=True)


def test_a_single_file_without_its_key_record_is_refused_under_fsdp2(tmp_path: Path) -> None:
    first = make_trainer(KIND, "2ba", save_folder=tmp_path, algorithm_options=SGD_GRAFTING_OPTIONS)
    first.fit()
    first.close()
    path = tmp_path / "ep0-ba2-rank0.pt"
    checkpoint = torch.load(path, weights_only=False)
    algorithms = dict(checkpoint["state"]["algorithms"])
    assert "optimizer_state_keys" in algorithms["Dash"]
    del algorithms["Dash"]["optimizer_state_keys"]  # as lightning-dash 0.4 wrote it
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="cannot load this single-file checkpoint: it does not record"):
        make_trainer(KIND, "4ba", load_path=str(path), algorithm_options=SGD_GRAFTING_OPTIONS, fsdp="full")

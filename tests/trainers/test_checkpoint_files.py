"""Checkpoints that are complete or refused (``lightning_dash.integration.checkpoint_files``):
publishing by rename, recovery after a crash between renames, and refusing truncated or
corrupted files with the file named. Real files: torch archives truncated at many lengths,
bytes flipped, and real ``torch.distributed.checkpoint`` folders with a shard cut short."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dash.integration.checkpoint_files import (
    METADATA_FILE,
    IncompleteCheckpointError,
    check_complete,
    check_replaceable,
    complete_checkpoint,
    publish,
    replaced_path,
    staged_write,
    staging_path,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def save_file(path: Path, value: float) -> Path:
    torch.save({"weights": torch.full((64, 64), value), "step": int(value)}, path)
    return path


def save_folder(path: Path, value: float) -> Path:
    """A distributed checkpoint folder as the strategies write it (one process: no group needed)."""
    dcp.save({"state_dict": {"w": torch.full((256,), value)}}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": int(value)}, path / METADATA_FILE)
    return path


def step_of(path: Path) -> int:
    if path.is_file():
        return torch.load(path)["step"]
    return torch.load(path / METADATA_FILE)["global_step"]


@pytest.mark.parametrize(
    "old_kind,new_kind", [("file", "file"), ("folder", "folder"), ("file", "folder"), ("folder", "file")]
)
def test_publishing_replaces_the_old_checkpoint_whole(tmp_path, old_kind, new_kind):
    saver = {"file": save_file, "folder": save_folder}
    path = saver[old_kind](tmp_path / "last.ckpt", 4)
    staged = saver[new_kind](staging_path(path), 6)
    check_replaceable(path)
    publish(staged, path)
    assert step_of(path) == 6 and not staged.exists() and not replaced_path(path).exists()
    check_complete(path)


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(IsADirectoryError, match="results"):
        check_replaceable(folder)


def test_a_crash_between_the_two_renames_loads_the_newer_complete_copy(tmp_path):
    path = tmp_path / "last.ckpt"
    save_folder(replaced_path(path), 4)  # the old one, moved aside
    save_folder(staging_path(path), 6)  # the new one, complete, not yet moved in
    with pytest.warns(UserWarning, match="interrupted"):
        assert step_of(complete_checkpoint(path)) == 6
    # the new one incomplete (its metadata never written): the old one
    (staging_path(path) / METADATA_FILE).unlink()
    with pytest.warns(UserWarning, match="interrupted"):
        assert step_of(complete_checkpoint(path)) == 4


def test_no_checkpoint_at_all_is_a_file_not_found_error_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        complete_checkpoint(tmp_path / "nothing.ckpt")


def test_a_file_truncated_at_any_length_is_refused_with_its_name(tmp_path):
    whole = save_file(tmp_path / "whole.ckpt", 3).read_bytes()
    assert len(whole) > 16_000
    for length in (0, 1, 3, 4, 30, 100, 1000, len(whole) // 2, len(whole) - 22, len(whole) - 1):
        path = tmp_path / f"cut_{length}.ckpt"
        path.write_bytes(whole[:length])
        with pytest.raises(IncompleteCheckpointError, match=path.name):
            check_complete(path)


def test_a_flipped_byte_is_refused_where_torch_load_would_read_wrong_values(tmp_path):
    path = save_file(tmp_path / "model.ckpt", 3)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path)["weights"], torch.full((64, 64), 3.0))  # the silent failure
    with pytest.raises(IncompleteCheckpointError, match="model.ckpt.*CRC"):
        check_complete(path)


def test_a_folder_with_a_shard_cut_short_or_missing_is_refused_naming_the_shard(tmp_path):
    folder = save_folder(tmp_path / "sharded.ckpt", 5)
    check_complete(folder)
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    size = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(size - 100)
    with pytest.raises(IncompleteCheckpointError, match=f"{shard.name} is truncated: {size - 100} bytes"):
        check_complete(folder)
    shard.unlink()
    with pytest.raises(IncompleteCheckpointError, match=f"missing its shard file {shard.name}"):
        check_complete(folder)


@pytest.mark.parametrize("missing", [".metadata", METADATA_FILE])
def test_a_folder_without_either_metadata_file_is_refused(tmp_path, missing):
    folder = save_folder(tmp_path / "sharded.ckpt", 5)
    os.remove(folder / missing)
    with pytest.raises(IncompleteCheckpointError, match=f"has no {missing}"):
        check_complete(folder)


def test_truncated_shard_metadata_is_refused_naming_it(tmp_path):
    folder = save_folder(tmp_path / "sharded.ckpt", 5)
    metadata = folder / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:10])
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata is truncated or corrupted"):
        check_complete(folder)


def test_a_staged_write_that_raises_publishes_nothing_and_the_next_one_replaces_the_checkpoint(tmp_path):
    path = save_folder(tmp_path / "last.ckpt", 4)
    with pytest.raises(RuntimeError, match="crash"):
        with staged_write(path, True, lambda: None) as staged:
            save_folder(staged, 6)
            raise RuntimeError("crash while writing")
    assert step_of(path) == 4 and staging_path(path).exists()  # the old checkpoint, untouched
    with staged_write(path, True, lambda: None) as staged:  # clears the leftover, then publishes
        assert not staged.exists()
        save_file(staged, 8)
    assert step_of(path) == 8 and not staging_path(path).exists()

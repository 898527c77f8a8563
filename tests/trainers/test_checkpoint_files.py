"""Checkpoints that are complete or refused (``lightning_dash.integration.checkpoint_files``):
publishing by rename, recovery after a crash between renames, and refusing truncated or
corrupted files with the file named, shards stamped and checked, and the leftovers of an
interrupted save named at load and removed by the next save. Real files: torch archives
truncated at many lengths, bytes flipped, real ``torch.distributed.checkpoint`` folders with
a shard cut short, swapped or changed, and a save killed by SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dash.integration import checkpoint_files
from lightning_dash.integration.checkpoint_files import (
    METADATA_FILE,
    STAMPS_FILE,
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


def save_stamped(path: Path, step: int) -> Path:
    """A distributed checkpoint folder saved as the strategies save it: staged, stamped, published."""
    with staged_write(path, True, lambda: None, step=step) as staged:
        save_folder(staged, step)
    return path


@pytest.mark.parametrize("leftover_of", [staging_path, replaced_path])
def test_a_leftover_beside_the_checkpoint_is_named_at_load_and_removed_by_the_next_save(tmp_path, leftover_of):
    path = save_stamped(tmp_path / "last.ckpt", 4)
    leftover = save_folder(leftover_of(path), 6)
    with pytest.warns(UserWarning, match=f"{leftover.name} lies beside the checkpoint .*next save to .* removes it"):
        assert step_of(complete_checkpoint(path)) == 4
    assert leftover.is_dir()  # loading removes nothing
    save_stamped(path, 8)
    assert step_of(path) == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.multiprocess
def test_a_save_killed_while_writing_leaves_a_leftover_that_the_next_save_removes(tmp_path):
    path = save_stamped(tmp_path / "last.ckpt", 4)
    module = Path(checkpoint_files.__file__)
    killed = textwrap.dedent(f"""
        import importlib.util, os, signal, torch
        import torch.distributed.checkpoint as dcp
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("checkpoint_files", {str(module)!r})
        files = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(files)
        with files.staged_write(Path({str(path)!r}), True, lambda: None, step=6) as staged:
            dcp.save({{"state_dict": {{"w": torch.zeros(256)}}}}, checkpoint_id=str(staged), no_dist=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", killed]).returncode == -signal.SIGKILL
    leftover = staging_path(path)
    assert leftover.is_dir() and not (leftover / STAMPS_FILE).exists()
    with pytest.warns(UserWarning, match=f"{leftover.name} lies beside the checkpoint"):
        assert step_of(complete_checkpoint(path)) == 4
    save_stamped(path, 8)
    assert step_of(path) == 8 and not leftover.exists()


def test_a_shard_copied_in_from_another_step_is_refused_naming_it_and_both_steps(tmp_path):
    older = save_stamped(tmp_path / "step=40.ckpt", 40)
    path = save_stamped(tmp_path / "step=50.ckpt", 50)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes((older / shard.name).read_bytes())
    message = f"{shard.name} holds step 40, the checkpoint is step 50: it was copied in from .*step=40.ckpt"
    with pytest.raises(IncompleteCheckpointError, match=message):
        complete_checkpoint(path)


def test_a_changed_byte_in_a_shard_is_a_checksum_mismatch_naming_it(tmp_path):
    path = save_stamped(tmp_path / "last.ckpt", 5)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IncompleteCheckpointError, match=f"checksum mismatch: the file .*{shard.name} has sha256"):
        complete_checkpoint(path)


def test_a_checkpoint_saved_before_stamps_existed_still_loads(tmp_path, caplog):
    path = save_stamped(tmp_path / "last.ckpt", 5)
    assert set(json.loads((path / STAMPS_FILE).read_text())["sha256"]) == {p.name for p in path.iterdir()} - {
        STAMPS_FILE
    }
    (path / STAMPS_FILE).unlink()  # what the code before stamps wrote
    with caplog.at_level(logging.INFO, logger="lightning_dash"):
        assert complete_checkpoint(path) == path
    assert "shards are not checked" in caplog.text
    state = {"state_dict": {"w": torch.empty(256)}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(state["state_dict"]["w"], torch.full((256,), 5.0))


def test_truncated_stamps_are_refused_naming_them(tmp_path):
    path = save_stamped(tmp_path / "last.ckpt", 5)
    stamps = path / STAMPS_FILE
    stamps.write_text(stamps.read_text()[:20])
    with pytest.raises(IncompleteCheckpointError, match=f"{STAMPS_FILE} is truncated or corrupted"):
        complete_checkpoint(path)

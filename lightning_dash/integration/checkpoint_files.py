"""Checkpoints that are complete or refused: staged writes, published by rename, checked at load.

A checkpoint is written under a staging name beside its destination (``<name>.partial``)
and moved onto the destination only once every rank has finished, so a crash while
writing leaves the previous checkpoint as it was. A folder cannot replace a folder in one
rename: the old one is moved aside (``<name>.replaced``) first, and a crash between the two
renames is recovered at load by :func:`complete_checkpoint`, which prefers the newer
complete copy. A leftover of an interrupted save beside a checkpoint is named in a
warning when that checkpoint is loaded and removed by the next save to the same path.

Before a distributed checkpoint folder is published, its first rank stamps every file in
it (:data:`STAMPS_FILE`: the training step and each file's SHA-256). At load, the folder
is checked against its own metadata (every shard file present and as long as the metadata
says) and against its stamps (a shard changed or copied in from another checkpoint is
named, with the step it holds where another checkpoint beside it stamped it); a folder
written before stamps existed is loaded unchecked. A single file must be a whole torch
archive with intact checksums. Anything else raises :class:`IncompleteCheckpointError`
naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

#: The file beside a distributed checkpoint's shards with everything that is not a
#: model or optimizer (Lightning's and Fabric's name for it).
METADATA_FILE = "meta.pt"
#: The file ``torch.distributed.checkpoint`` writes last, listing every shard.
DCP_METADATA_FILE = ".metadata"
#: The file a distributed checkpoint folder's first rank writes last: the training step and
#: every other file's SHA-256.
STAMPS_FILE = "stamps.json"
#: How a zip archive (``torch.save``'s format) begins.
ZIP_MAGIC = b"PK\x03\x04"

_log = logging.getLogger(__name__)


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint that is truncated, corrupted or missing part of its files."""


def staging_path(path: Path) -> Path:
    """Where the checkpoint for ``path`` is written before it is published."""
    return path.with_name(f"{path.name}.partial")


def replaced_path(path: Path) -> Path:
    """Where a folder checkpoint at ``path`` waits while its successor is moved in."""
    return path.with_name(f"{path.name}.replaced")


def remove(path: Path) -> None:
    """Delete the file or folder at ``path``, if any."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_replaceable(path: Path) -> None:
    """Refuse to save onto ``path`` where a folder is there that is not a checkpoint (publishing
    would delete it)."""
    if path.is_dir() and not (is_distributed_checkpoint(path) or (path / DCP_METADATA_FILE).is_file()):
        raise IsADirectoryError(f"the checkpoint path exists and is a folder that is not a checkpoint: {path}")


def publish(staged: Path, path: Path) -> None:
    """Move the complete checkpoint ``staged`` onto ``path``, replacing what is there: one
    atomic rename for a file onto a file; for a folder, the old one moved aside first."""
    if staged.is_file() and not path.is_dir():
        os.replace(staged, path)
        return
    aside = replaced_path(path)
    remove(aside)
    if path.exists():
        os.rename(path, aside)
    os.rename(staged, path)
    remove(aside)


def file_digest(path: Path) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_stamps(folder: Path, step: int | None) -> None:
    """Stamp every file of the checkpoint folder ``folder`` with ``step`` and its SHA-256, in
    :data:`STAMPS_FILE`."""
    files = sorted(file for file in folder.iterdir() if file.is_file() and file.name != STAMPS_FILE)
    stamps = {"step": step, "sha256": {file.name: file_digest(file) for file in files}}
    (folder / STAMPS_FILE).write_text(json.dumps(stamps, indent=1))


def read_stamps(folder: Path) -> dict[str, Any] | None:
    """The stamps of the checkpoint folder ``folder`` (``step`` and ``sha256``, by file name),
    or None where it has none (written before stamps existed)."""
    file = folder / STAMPS_FILE
    if not file.is_file():
        return None
    try:
        stamps = json.loads(file.read_text())
        return {"step": stamps["step"], "sha256": dict(stamps["sha256"])}
    except (ValueError, KeyError, TypeError) as error:
        raise IncompleteCheckpointError(f"{file} is truncated or corrupted: {error!r}") from error


def stamped_as(folder: Path, digest: str) -> tuple[Path, int | None] | None:
    """Another checkpoint folder beside ``folder`` that stamped a file with ``digest``, and its step."""
    for other in sorted(folder.parent.iterdir()):
        if other == folder or not other.is_dir():
            continue
        try:
            stamps = read_stamps(other)
        except IncompleteCheckpointError:
            continue
        if stamps is not None and digest in stamps["sha256"].values():
            return other, stamps["step"]
    return None


def check_stamps(folder: Path) -> None:
    """Raise :class:`IncompleteCheckpointError` naming the first file of the checkpoint folder
    ``folder`` that is not what its stamp says; a folder without stamps is accepted unchecked."""
    stamps = read_stamps(folder)
    if stamps is None:
        _log.info(
            "%s has no %s (it was saved before shards were stamped): its shards are not checked", folder, STAMPS_FILE
        )
        return
    step = stamps["step"]
    for name, expected in sorted(stamps["sha256"].items()):
        file = folder / name
        if not file.is_file():
            raise IncompleteCheckpointError(f"the checkpoint folder {folder} is missing its file {name}")
        found = file_digest(file)
        if found == expected:
            continue
        origin = stamped_as(folder, found)
        if origin is None:
            raise IncompleteCheckpointError(
                f"checksum mismatch: the file {file} has sha256 {found}, where the checkpoint (step {step}) "
                f"stamped {expected} when it was saved: it was changed or replaced since"
            )
        other, held = origin
        if held is not None and step is not None and held != step:
            raise IncompleteCheckpointError(
                f"the file {file} holds step {held}, the checkpoint is step {step}: it was copied in from {other}"
            )
        raise IncompleteCheckpointError(f"the file {file} is not this checkpoint's: it was copied in from {other}")


@contextmanager
def staged_write(path: Path, first_rank: bool, barrier: Callable[[], None], step: int | None = None) -> Iterator[Path]:
    """Collective: the path every rank writes its part of the checkpoint for ``path`` to.
    The first rank clears what a crashed save left there before anyone writes; once every
    rank has finished, it stamps a folder with ``step`` (:func:`write_stamps`) and moves the
    result onto ``path``. If writing raises, nothing moves."""
    check_replaceable(path)
    staged = staging_path(path)
    if first_rank and (staged.exists() or staged.is_symlink()):
        _log.info("removing %s, left by an interrupted save", staged)
        remove(staged)
    barrier()
    yield staged
    barrier()
    if first_rank:
        if staged.is_dir():
            write_stamps(staged, step)
        publish(staged, path)
    barrier()


def is_distributed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``torch.distributed.checkpoint`` (with its metadata file)."""
    return path.is_dir() and (path / METADATA_FILE).is_file()


def check_complete(path: Path) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``path`` is a whole checkpoint: a torch
    archive whose every record matches its CRC-32 (one read of the file), or a distributed
    checkpoint folder whose metadata files are there and load, whose every shard file is
    present and as long as the metadata says, and whose files match their stamps
    (:func:`check_stamps`: one read of the folder)."""
    if path.is_file():
        with path.open("rb") as file:
            head = file.read(len(ZIP_MAGIC))
        if len(head) < len(ZIP_MAGIC) and ZIP_MAGIC.startswith(head):
            raise IncompleteCheckpointError(f"the checkpoint file {path} is truncated: {len(head)} bytes")
        if head != ZIP_MAGIC:  # torch's legacy format: reading it names the file if it fails
            return
        try:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()  # reads every record against its CRC-32
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise IncompleteCheckpointError(
                f"the checkpoint file {path} ({path.stat().st_size} bytes) is truncated or corrupted: "
                f"it is not a whole torch archive ({error})"
            ) from error
        if damaged is not None:
            raise IncompleteCheckpointError(f"the checkpoint file {path} is corrupted: record {damaged} fails its CRC")
        return
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path} (neither a file nor a distributed checkpoint folder)")
    for name in (DCP_METADATA_FILE, METADATA_FILE):
        if not (path / name).is_file():
            raise IncompleteCheckpointError(
                f"the checkpoint folder {path} has no {name}: it was not completely written"
            )
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as error:
        raise IncompleteCheckpointError(f"{path / DCP_METADATA_FILE} is truncated or corrupted: {error}") from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise IncompleteCheckpointError(f"the checkpoint folder {path} is missing its shard file {name}")
        if shard.stat().st_size < length:
            raise IncompleteCheckpointError(
                f"the shard file {shard} is truncated: {shard.stat().st_size} bytes where its metadata needs {length}"
            )
    check_stamps(path)


def local_path(value: Any) -> Path | None:
    """``value`` as a local path, or None for a URL (``s3://...``) or anything else."""
    if isinstance(value, (str, os.PathLike)) and "://" not in str(value):
        return Path(value)
    return None


def complete_checkpoint(path: Path) -> Path:
    """The complete checkpoint ``path`` names, checked: ``path`` itself (with a warning naming
    any leftover of an interrupted save beside it), or, where a crash fell between the two
    renames of :func:`publish`, its newer staged copy when that is complete, else the older
    one moved aside (with a warning saying which)."""
    if not path.exists():
        for candidate in (staging_path(path), replaced_path(path)):
            try:
                check_complete(candidate)
            except (FileNotFoundError, IncompleteCheckpointError):
                continue
            warnings.warn(
                f"no checkpoint at {path}: a save was interrupted while replacing it; loading the complete "
                f"copy {candidate}",
                stacklevel=3,
            )
            return candidate
    check_complete(path)
    for leftover in (staging_path(path), replaced_path(path)):
        if leftover.exists():
            warnings.warn(
                f"{leftover} lies beside the checkpoint {path}: it was left by a save that was interrupted (or "
                f"is still under way); it is not loaded, and the next save to {path} removes it",
                stacklevel=3,
            )
    return path


def load_file(path: Path, **options: Any) -> Any:
    """``torch.load(path, **options)``, with a failure that names the file."""
    try:
        return torch.load(path, **options)
    except Exception as error:
        raise IncompleteCheckpointError(f"could not read the checkpoint file {path}: {error}") from error

"""Checkpoint folders on disk: safe metadata reading, integrity checks, atomic commit, discovery.

A checkpoint is a folder holding DCP's files (``.metadata``, one ``__<rank>_<n>.distcp`` per writer), our plain
data (``dist_optim.json``) and a commit marker (``COMMITTED``: sizes and SHA-256 of every file). Each save writes
into a staging folder of its own, ``<name>.partial/<token>``, and rank 0 renames it to ``<name>`` once every rank
has written and the marker is on disk; a second job saving the same name never touches the first one's files."""

from __future__ import annotations

import dataclasses
import enum
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from dist_optim._torch_internals import PICKLED_LAYOUT

__all__: list[str] = []

PLAIN_FILE = "dist_optim.json"
MARKER = "COMMITTED"
OWNER = "OWNER"
PARTIAL = ".partial"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, corrupted, or not what is being loaded."""


# -- reading DCP's metadata without executing code -------------------------------------------------------------
_DCP_DATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {
    ("torch", "Size"), PICKLED_LAYOUT, ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata data classes and enums, torch dtypes/layouts/memory formats, ``torch.Size``
    and a few containers; any other global (a function to call, a class with a custom ``__reduce__``) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_DATA_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load global {module}.{name} from checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file system reader with a restricted unpickler for ``.metadata`` (tensor data is already read with
    ``torch.load(weights_only=True)`` by DCP)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: {self.path} is not a complete DCP checkpoint") from None
        except Exception as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is corrupted") from e
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_files(folder: Path, metadata: Any) -> None:
    """Every data file the metadata refers to exists and is long enough (a truncated shard is named)."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    root = folder.resolve()
    for rel, size in sorted(need.items()):
        f = folder / rel
        if (not isinstance(rel, str) or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts
                or not f.resolve().is_relative_to(root)):
            raise CheckpointError(
                f"{folder / '.metadata'}: storage path {rel!r} points outside the checkpoint folder {folder}; a "
                "checkpoint only reads its own files (the metadata was edited or written by something else)"
            )
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint's metadata refers to it")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{f} is truncated: {have} bytes on disk, the metadata needs {size}")


def file_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_marker(folder: Path) -> dict[str, Any]:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / MARKER} cannot be read ({e}); the checkpoint's commit marker is damaged") from e
    if not isinstance(marker, dict) or not isinstance(marker.get("sha256", {}), dict):
        raise CheckpointError(f"{folder / MARKER} is not a dist_optim commit marker")
    return marker


def verify_hashes(folder: Path) -> None:
    """Every file recorded at commit still has its content (a shard copied from another checkpoint of the same
    size is caught here). Checkpoints committed before hashes were recorded are not checked."""
    for name, want in sorted(read_marker(folder).get("sha256", {}).items()):
        f = folder / name
        if Path(name).name != name or not f.is_file():
            raise CheckpointError(f"{f} is missing: the commit marker recorded it")
        if file_hash(f) != want:
            raise CheckpointError(
                f"{f} does not hold the content written at commit (SHA-256 differs): it was modified or copied from "
                "another checkpoint; restore it from the same save or use another checkpoint"
            )


def read_plain(folder: Path) -> dict[str, Any]:
    from ._codec import loads

    marker = folder / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{folder} has no {MARKER} marker: it is not a committed dist_optim checkpoint (a save that did not "
            "finish, or a folder written by something else)"
        )
    path = folder / PLAIN_FILE
    try:
        return loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {folder} is not a complete dist_optim checkpoint") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from e


# -- writing ---------------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL)


def prepare(final: Path) -> Path:
    """Rank 0, before anyone writes: refuse to overwrite, then create this save's own staging folder."""
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; remove it or save under another name/step")
    parent = partial_path(final)
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / uuid.uuid4().hex
    staging.mkdir()  # exclusive: fails rather than share a folder with another save
    owner = {"token": staging.name, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    with open(staging / OWNER, "x") as f:
        json.dump(owner, f)
    return staging


def _owner_token(staging: Path) -> str | None:
    try:
        return json.loads((staging / OWNER).read_text()).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def commit(final: Path, staging: Path, plain_text: str, marker: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: plain data, marker with the files' hashes, then the rename that makes
    it visible. Refuses a staging folder that is not this save's, or a name another save committed meanwhile."""
    if _owner_token(staging) != staging.name:
        raise CheckpointError(f"{staging} no longer belongs to this save (its owner token is gone): not committing")
    if not (staging / ".metadata").is_file():
        raise CheckpointError(f"{staging} has no .metadata after the save: not committing it")
    write_file(staging / PLAIN_FILE, plain_text)
    files = [p for p in sorted(staging.iterdir()) if p.is_file()]
    sizes = {p.name: p.stat().st_size for p in files}
    hashes = {p.name: file_hash(p) for p in files}
    write_file(staging / MARKER, json.dumps({**marker, "token": staging.name, "files": sizes, "sha256": hashes},
                                            indent=1))
    _fsync_dir(staging)
    try:
        if final.exists():
            raise FileExistsError(errno.EEXIST, "exists")
        os.rename(staging, final)  # onto a non-empty folder this fails: the first of two racing saves wins
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint {final} was committed by another save while this one was writing; this save's files were "
            "removed. Give concurrent jobs different folders"
        ) from e
    # other saves staged under this name can no longer commit; a crashed one's files would stay forever
    shutil.rmtree(partial_path(final), ignore_errors=True)
    _fsync_dir(final.parent)


def remove_staging(staging: Path) -> None:
    """Rank 0, after a failed save: remove this save's own staging folder (and the parent if it is now empty)."""
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.parent.rmdir()
    except OSError:
        pass


# -- discovery -------------------------------------------------------------------------------------------------
def committed(directory: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the committed ``step_<n>`` checkpoints under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = STEP_DIR.match(p.name)
        # without .metadata a folder is not loadable, whatever its marker says: never "latest", never pruned for
        if m and p.is_dir() and (p / MARKER).is_file() and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune(directory: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest committed checkpoints (partial folders are never touched)."""
    done = committed(directory)
    removed = []
    for _, p in done[: max(len(done) - keep_last, 0)]:
        # rename first: a crash half-way through the deletion leaves no folder that looks committed
        doomed = p.with_name(p.name + ".deleting")
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(p)
    return removed

"""Checkpoint folders on disk: safe metadata reading, integrity checks, atomic commit, discovery.

A checkpoint is a folder holding DCP's files (``.metadata``, one ``__<rank>_<n>.distcp`` per writer), our plain
data (``dist_optim.json``) and a commit marker (``COMMITTED``). It is written under ``<name>.partial`` and renamed
to ``<name>`` by rank 0 once every rank has written (DCP writes ``.metadata`` only after gathering every rank's
write results) and the marker is on disk: a folder without the ``.partial`` suffix is complete.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

__all__: list[str] = []

PLAIN_FILE = "dist_optim.json"
MARKER = "COMMITTED"
PARTIAL = ".partial"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, corrupted, or not what is being loaded."""


# -- reading DCP's metadata without executing code -------------------------------------------------------------
_DCP_DATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
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
    for rel, size in sorted(need.items()):
        f = folder / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint's metadata refers to it")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{f} is truncated: {have} bytes on disk, the metadata needs {size}")


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
    """Rank 0, before anyone writes: refuse to overwrite, clear a stale partial folder, create a fresh one."""
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; remove it or save under another name/step")
    tmp = partial_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(final: Path, plain_text: str, marker: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: plain data, marker, then the rename that makes it visible."""
    tmp = partial_path(final)
    if not (tmp / ".metadata").is_file():
        raise CheckpointError(f"{tmp} has no .metadata after the save: not committing it")
    write_file(tmp / PLAIN_FILE, plain_text)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    write_file(tmp / MARKER, json.dumps({**marker, "files": files}, indent=1))
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


# -- discovery -------------------------------------------------------------------------------------------------
def committed(directory: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the committed ``step_<n>`` checkpoints under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
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

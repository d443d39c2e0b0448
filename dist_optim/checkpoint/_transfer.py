"""The two halves every component works with: a :class:`Snapshot` it adds to when saving, and a :class:`Source`
it plans its part of the one DCP read from when loading.

Components only describe tensors (key -> tensor to write, key -> tensor to fill); the DCP calls happen once, here,
after every component has checked what it needs, so a refused load has changed nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._names import Remap, mismatch_message
from ._storage import CheckpointError, SafeReader

__all__: list[str] = []


@contextlib.contextmanager
def single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


@dataclass
class Snapshot:
    """What a save writes: tensors through DCP (``"model/<name>"``, ``"optim/<name>/<key>"``...) and plain data
    as JSON (``dist_optim.json``)."""

    tensors: dict[str, Any] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)


class Source:
    """One checkpoint being loaded: its plain data, DCP metadata, name matching, and the tensors to read."""

    def __init__(self, folder: Path, plain: dict[str, Any], reader: SafeReader, metadata: Any, remap: Remap,
                 strict: bool) -> None:
        self.folder, self.plain, self.reader, self.metadata = folder, plain, reader, metadata
        self.remap, self.strict = remap, strict
        self.fresh: list[str] = []  # current names kept as they are (absent from the checkpoint)
        self.ignored: list[str] = []  # checkpoint names left unused
        self._load: dict[str, torch.Tensor] = {}  # DCP key -> tensor DCP fills
        self._copies: list[tuple[str, torch.Tensor]] = []  # a key read once, copied into more targets
        self._bad_shapes: list[str] = []

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.folder}: {message}")

    def required(self, key: str, what: str) -> Any:
        """The plain data saved under ``key``, for an object the caller passed: refused if none was saved."""
        if self.plain.get(key) is None:
            raise self.error(f"holds no {what} (none was saved)")
        return self.plain[key]

    def saved_keys(self, prefix: str) -> list[str]:
        """The names stored under ``prefix`` (``"averaged/"`` -> the averaged model's names)."""
        return [k[len(prefix):] for k in self.metadata.state_dict_metadata if k.startswith(prefix)]

    def tensor_meta(self, key: str) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(key)
        return md if isinstance(md, TensorStorageMetadata) else None

    def match(self, targets: Sequence[str], sources: Sequence[str], what: str) -> dict[str, str]:
        """``{current name: checkpoint name}`` after ``remap``; with ``strict`` a name missing on either side
        raises, listing both kinds."""
        mapping, missing, unexpected = self.remap.plan(targets, sources)
        if (missing or unexpected) and self.strict:
            raise CheckpointError(mismatch_message(f"{self.folder} ({what})", missing, unexpected))
        self.fresh.extend(missing + [t for t in targets if t not in mapping and t not in missing])
        self.ignored.extend(unexpected + [s for s in sources if self.remap.is_ignored(s) and s not in mapping.values()])
        return mapping

    def read_into(self, key: str, target: torch.Tensor, label: str) -> None:
        """Fill ``target`` with the stored tensor ``key`` during :meth:`transfer`."""
        md = self.tensor_meta(key)
        if md is None:
            raise self.error(f"{key!r} is not a tensor")
        if tuple(md.size) != tuple(target.shape):
            self._bad_shapes.append(f"{label}: checkpoint {tuple(md.size)} vs {tuple(target.shape)} ({key})")
            return
        if key in self._load:
            self._copies.append((key, target))
        else:
            self._load[key] = target

    def check_shapes(self) -> None:
        if self._bad_shapes:
            raise self.error(f"shapes differ for {len(self._bad_shapes)} tensor(s):\n  " + "\n  ".join(self._bad_shapes))

    def transfer(self, process_group: Any) -> None:
        """The one DCP read of every planned tensor. Collective."""
        self.check_shapes()
        with single_process_is_intended():
            dcp.load(self._load, storage_reader=self.reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                     process_group=process_group)
        with torch.no_grad():
            for key, target in self._copies:
                target.copy_(self._load[key])

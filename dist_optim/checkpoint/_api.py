"""save() and load(): one request object, every component collected or planned in turn, one DCP write or read."""

from __future__ import annotations

import errno
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from . import _ranks, _schema, _storage
from ._codec import dumps
from ._components import COMPONENTS
from ._names import Remap
from ._request import LoadRequest, Objects, SaveRequest
from ._transfer import Snapshot, Source, single_process_is_intended

__all__ = ["save", "load", "LoadResult", "AsyncSave"]

FORMAT = 1


class AsyncSave:
    """A save in flight (``save(..., async_save=True)``): the state was copied before ``save`` returned, so
    training may go on; the checkpoint becomes visible (committed by rank 0) when the upload finishes."""

    def __init__(self, future: Any, on_done: Any, cleanup: Any = None, on_error: Any = None) -> None:
        self._error: BaseException | None = None
        self._done = threading.Event()
        future = getattr(future, "upload_completion", future)

        def finish(f: Any) -> None:
            try:
                f.result()
                on_done()
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                self._error = on_error(e) if on_error is not None else e
            finally:
                if cleanup is not None:
                    cleanup()
                self._done.set()

        future.add_done_callback(finish)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's part is written (on rank 0: until the checkpoint is committed, which needs every
        rank's part); re-raises the save's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save still running after {timeout} s")
        if self._error is not None:
            raise self._error


def save(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    schedulers: Any = None,
    grad_scaler: Any = None,
    averaged_model: nn.Module | None = None,
    extra: dict[str, Any] | None = None,
    step: int | None = None,
    async_save: bool = False,
    process_group: Any = None,
    force: bool = False,
) -> AsyncSave | None:
    """Write a sharded checkpoint to the folder ``path``, atomically. Call it on every rank.

    Args:
        model: the model as trained: a plain module, an FSDP2 (``fully_shard``) module or a DDP object.
        optimizer: an :class:`~dist_optim.InBackwardOptimizer` or any ``torch.optim`` optimizer; its state is stored
            per parameter name, so it loads into either kind and onto any number of ranks.
        schedulers: an LR scheduler or a list of them.
        grad_scaler: a ``torch.amp.GradScaler``.
        averaged_model: an EMA/SWA ``torch.optim.swa_utils.AveragedModel``.
        extra: plain data of yours (data-loader position, ...), stored as JSON.
        step: the training step counter, returned by :func:`load`.
        async_save: copy the state, return an :class:`AsyncSave` at once and write in the background
            (``torch.distributed.checkpoint.async_save``); the copy is taken before this returns, so steps that run
            in the next backward do not leak into the checkpoint.
        process_group: the group to save over (default: the default group). Async saves should use a group of their
            own (the :class:`CheckpointManager` makes one), since the upload runs collectives from another thread.
        force: save even if the optimizer's in-backward step is incomplete on some rank
            (:attr:`~dist_optim.InBackwardOptimizer.step_incomplete`: a backward raised or was interrupted after some
            buckets stepped, so layers disagree on the step count). Without it such a save is refused.

    Raises:
        CheckpointError: the optimizer's step is incomplete (on every rank, so none waits for the others), or the
            write failed.

    Each rank writes its own shards; DTensor state stays sharded, replicated tensors are written once. Nothing is
    visible at ``path`` until every rank has finished and rank 0 has renamed ``<path>.partial`` to ``path``; a
    crash leaves at most a ``.partial`` folder, which :func:`load` refuses and discovery ignores.
    """
    objects = Objects(model, optimizer, schedulers, grad_scaler, averaged_model)
    return write(SaveRequest(path, objects, extra, step, async_save, process_group, force=force))


def write(req: SaveRequest) -> AsyncSave | None:
    """:func:`save` for a request (the manager adds ``after_commit``). Collective."""
    group = req.process_group
    snap = Snapshot(plain={"format": FORMAT, "step": req.step, "world_size": _ranks.world(group), "extra": req.extra})
    for component in COMPONENTS:
        component.collect(req, snap)
    text = dumps(snap.plain)  # refuses what JSON cannot hold before anything is written
    marker = {"format": FORMAT, "step": req.step, "world_size": _ranks.world(group), "time": time.time()}
    staging = _ranks.on_rank0(lambda: _storage.prepare(req.path), group)  # the other ranks wait for it here
    rank0 = _ranks.is_rank0(group)

    def commit() -> None:  # rank 0; the other ranks do no work after it that rank 0 would wait for
        try:
            _storage.commit(req.path, staging, text, marker)
        except Exception as e:  # every rank has finished writing: the staging folder is only ours to remove
            cause = e if isinstance(e, _storage.CheckpointError) else _storage.CheckpointError(
                f"saving {req.path} failed at commit: {_failure_cause(e, staging)}; the partial save was removed")
            _storage.remove_staging(staging)
            raise cause from e
        if req.after_commit is not None:
            req.after_commit()

    def failed(error: BaseException) -> BaseException:
        if isinstance(error, _storage.CheckpointError) or not isinstance(error, (Exception, CheckpointException)):
            return error  # already ours, or an interrupt: a crash leaves the staging folder, as documented
        if not staging.exists() and req.path.exists():
            cause = f"another save committed {req.path} while this one was writing (its staging folder is gone)"
        else:
            cause = _failure_cause(error, staging)  # before removing: the free space tells a full disk
        if not isinstance(error, CheckpointException):
            # a collective failed (a rank was lost): other ranks may still be writing there, as after a crash
            return _storage.CheckpointError(f"saving {req.path} failed: {cause}; {staging} is left for the next "
                                            "successful save of this name to remove")
        if rank0:  # DCP gathered every rank's failure: no rank writes there any more
            _storage.remove_staging(staging)
        return _storage.CheckpointError(f"saving {req.path} failed: {cause}; the partial save was removed")

    writer = FileSystemWriter(staging)
    try:
        with single_process_is_intended():
            if req.async_save:
                # DCP's default stager takes the CPU copy (the writer's own staging copies DTensors twice, 2-5x
                # slower)
                stager = DefaultStager(StagingOptions(False, False, False, False))
                future = dcp.async_save(snap.tensors, storage_writer=writer, process_group=group,
                                        async_stager=stager)
                return AsyncSave(future, commit if rank0 else lambda: None, stager.close, failed)
            dcp.save(snap.tensors, storage_writer=writer, process_group=group)
        _ranks.on_rank0(commit, group)
    except (Exception, CheckpointException) as e:
        raise failed(e) from e
    return None


def _failure_cause(error: BaseException, staging: Path) -> str:
    """The underlying error of a failed write, in words: DCP wraps every rank's exception in a
    ``CheckpointException`` (a ``BaseException``) whose text for a full disk is torch's ``unexpected pos``."""
    found = [exc for exc, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    ranks = list(error.failures) if isinstance(error, CheckpointException) else [None]
    chain: list[BaseException] = []
    for exc in found:
        while exc is not None and exc not in chain:
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
    try:
        free = shutil.disk_usage(staging.parent).free
    except OSError:
        free = None
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain) or (free is not None and free < 2**20):
        return f"no space left on the device of {staging.parent} ({free} bytes free)"
    where = f" on rank {ranks[0]}" if ranks[0] is not None else ""
    return f"{type(found[0]).__name__}{where}: {found[0]}"


@dataclass
class LoadResult:
    """What :func:`load` restored. ``fresh`` lists the names that were absent from the checkpoint and kept their
    current values (allowed by ``Remap(fresh=...)`` or ``strict=False``); ``ignored`` the checkpoint names left
    unused."""

    path: Path
    step: int | None
    extra: dict[str, Any]
    world_size: int
    fresh: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def load(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    schedulers: Any = None,
    grad_scaler: Any = None,
    averaged_model: nn.Module | None = None,
    remap: Remap | None = None,
    strict: bool = True,
    restore_rng: bool = True,
    process_group: Any = None,
) -> LoadResult:
    """Load a checkpoint written by :func:`save` into the given objects, in place. Call it on every rank. Only
    the objects passed are loaded (``load(path, model=model)`` for evaluation).

    The world size and wrapper may differ from the saving job's (FSDP2 on 2 ranks -> plain model on 1 -> DDP on
    4 ...); so may the optimizer kind (a standard optimizer's checkpoint resumes in backward and the other way
    round). Parameters are matched by name (wrapper prefixes removed, then ``remap``). With ``strict`` (default),
    any name missing on either side raises one :class:`CheckpointError` listing both kinds with their closest
    candidates, before anything is modified. The optimizer's implementation flags (``foreach``, ``fused``,
    ``capturable``, ``differentiable``) stay as the current optimizer has them; everything it learned (state,
    ``lr``, ``betas``, ``initial_lr``...) comes from the checkpoint.

    RNG states are restored per rank when ``restore_rng``: rank ``r`` gets saved rank ``r % saved_world_size``'s.
    """
    objects = Objects(model, optimizer, schedulers, grad_scaler, averaged_model)
    return read(LoadRequest(path, objects, remap, strict, restore_rng, process_group))


def open_source(req: LoadRequest) -> Source:
    """The checkpoint at ``req.path``, checked as a whole (marker, format, metadata, files) before any component
    looks at it."""
    folder = req.path
    if not folder.is_dir():
        hint = " (an unfinished save)" if _storage.partial_path(folder).is_dir() else ""
        raise _storage.CheckpointError(f"no checkpoint folder at {folder}{hint}")
    plain = _storage.read_plain(folder)
    if not isinstance(plain, dict) or plain.get("format") != FORMAT:
        found = plain.get("format") if isinstance(plain, dict) else None
        raise _storage.CheckpointError(f"{folder}: checkpoint format {found!r}, expected {FORMAT}")
    reader = _storage.SafeReader(folder)
    metadata = reader.read_metadata()
    _storage.check_files(folder, metadata)
    # rank 0 reads every file once for the whole job; all ranks read the same folder
    _ranks.on_rank0(lambda: _storage.verify_hashes(folder), req.process_group)
    _schema.validate(plain, str(folder))
    return Source(folder, plain, reader, metadata, req.remap, req.strict)


def read(req: LoadRequest) -> LoadResult:
    """:func:`load` for a request. Collective."""
    src = open_source(req)
    applies = [component.plan(req, src) for component in COMPONENTS]
    src.transfer(req.process_group)
    for apply in applies:
        if apply is not None:
            apply()
    plain = src.plain
    return LoadResult(src.folder, plain.get("step"), plain.get("extra") or {}, int(plain.get("world_size", 1)),
                      sorted(set(src.fresh)), sorted(set(src.ignored)))

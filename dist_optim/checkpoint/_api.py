"""save() and load(): what goes into a checkpoint and how it comes back."""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .._inputs import is_dtensor
from . import _storage
from ._codec import dumps
from ._names import Remap, canonical_names, mismatch_message

__all__ = ["save", "load", "LoadResult", "AsyncSave"]

FORMAT = 1
# How the current optimizer computes, not what it learned: kept from the optimizer being loaded into.
_IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


# -- helpers ---------------------------------------------------------------------------------------------------
def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _on_rank0(fn: Any, group: Any) -> Any:
    """Run ``fn`` on rank 0; every rank returns its result or raises its exception."""
    result: list[Any] = [None, None]
    if _rank(group) == 0:
        try:
            result = [fn(), None]
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank below
            result = [None, e]
    if _distributed(group):
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(result, src=src, group=group)
    if result[1] is not None:
        raise result[1]
    return result[0]


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _schedulers(schedulers: Any) -> list[Any]:
    if schedulers is None:
        return []
    return [schedulers] if hasattr(schedulers, "state_dict") else list(schedulers)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The checkpoint name of every optimizer parameter, group by group."""
    names = {id(p): n for n, p in canonical_names(_module(model).named_parameters(), "model").items()}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        row = []
        for k, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) is not a parameter of the "
                    "model given: checkpoints key optimizer state by the model's parameter names; pass the model "
                    "the optimizer trains"
                )
            row.append(names[id(p)])
        out.append(row)
    return out


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _plain_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (name, keys.tolist(), pos, has_gauss, gauss)
    return out


def _set_plain_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


# -- save ------------------------------------------------------------------------------------------------------
def _collect(model, optimizer, schedulers, grad_scaler, averaged_model, extra, step, group):
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {"format": FORMAT, "step": step, "world_size": _world(group), "extra": extra or {}}
    for name, t in canonical_names(_module(model).state_dict().items(), "model").items():
        tensors[f"model/{name}"] = t
    plain["model"] = sorted(k[len("model/"):] for k in tensors)
    if optimizer is not None:
        names = _param_names(model, optimizer)
        groups, values = [], {}
        for group_names, g in zip(names, optimizer.param_groups):
            for name, p in zip(group_names, g["params"]):
                for key, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 or is_dtensor(v):
                        tensors[f"optim/{name}/{key}"] = v
                    elif isinstance(v, torch.Tensor):
                        tensors[f"optim/{name}/{key}"] = v.detach().clone()  # scalar ("step"): a snapshot
                    else:
                        values.setdefault(name, {})[key] = v
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": group_names})
        plain["optimizer"] = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                              "param_groups": groups, "values": values}
        if hasattr(optimizer, "_in_backward_state"):  # e.g. the previous norm of clip_mode="previous_norm"
            plain["optimizer"]["in_backward"] = optimizer._in_backward_state()
    plain["schedulers"] = [s.state_dict() for s in _schedulers(schedulers)]
    plain["grad_scaler"] = grad_scaler.state_dict() if grad_scaler is not None else None
    if averaged_model is not None:
        for name, t in canonical_names(averaged_model.state_dict().items(), "averaged_model").items():
            tensors[f"averaged/{name}"] = t
    rank = _rank(group)
    for kind, t in _rng_tensors().items():
        tensors[f"rng/{rank}/{kind}"] = t
    rng: list[Any] = [_plain_rng()]
    if _distributed(group):
        rng = [None] * _world(group)
        dist.all_gather_object(rng, _plain_rng(), group=group)
    plain["rng"] = rng
    return tensors, plain


class AsyncSave:
    """A save in flight (``save(..., async_save=True)``): the state was copied before ``save`` returned, so
    training may go on; the checkpoint becomes visible (committed by rank 0) when the upload finishes."""

    def __init__(self, future: Any, on_done: Any, cleanup: Any = None) -> None:
        self._error: BaseException | None = None
        self._done = threading.Event()
        future = getattr(future, "upload_completion", future)

        def finish(f: Any) -> None:
            try:
                f.result()
                on_done()
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                self._error = e
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

    Each rank writes its own shards; DTensor state stays sharded, replicated tensors are written once. Nothing is
    visible at ``path`` until every rank has finished and rank 0 has renamed ``<path>.partial`` to ``path``; a
    crash leaves at most a ``.partial`` folder, which :func:`load` refuses and discovery ignores.
    """
    return _save(Path(path), model, optimizer, schedulers, grad_scaler, averaged_model, extra, step, async_save,
                 process_group)


def _save(path: Path, model, optimizer, schedulers, grad_scaler, averaged_model, extra, step, async_save,
          process_group, after_commit: Callable[[], Any] | None = None) -> AsyncSave | None:
    tensors, plain = _collect(model, optimizer, schedulers, grad_scaler, averaged_model, extra, step, process_group)
    text = dumps(plain)  # refuses what JSON cannot hold before anything is written
    marker = {"format": FORMAT, "step": step, "world_size": _world(process_group), "time": time.time()}
    _on_rank0(lambda: _storage.prepare(path), process_group)  # the other ranks wait for it here

    def commit() -> None:  # rank 0; the other ranks do no work after it that rank 0 would wait for
        _storage.commit(path, text, marker)
        if after_commit is not None:
            after_commit()

    writer = FileSystemWriter(_storage.partial_path(path))
    rank0 = _rank(process_group) == 0
    with _single_process_is_intended():
        if async_save:
            # DCP's default stager takes the CPU copy (the writer's own staging copies DTensors twice, 2-5x slower)
            stager = DefaultStager(StagingOptions(False, False, False, False))
            future = dcp.async_save(tensors, storage_writer=writer, process_group=process_group, async_stager=stager)
            return AsyncSave(future, commit if rank0 else lambda: None, stager.close)
        dcp.save(tensors, storage_writer=writer, process_group=process_group)
    _on_rank0(commit, process_group)
    return None


# -- load ------------------------------------------------------------------------------------------------------
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


def _tensor_meta(metadata: Any, key: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = metadata.state_dict_metadata.get(key)
    return md if isinstance(md, TensorStorageMetadata) else None


class _Plan:
    """Source keys -> target tensors for one dcp.load, plus the copies for duplicated sources."""

    def __init__(self, reader: _storage.SafeReader, metadata: Any, where: str) -> None:
        self.reader, self.metadata, self.where = reader, metadata, where
        self.load: dict[str, torch.Tensor] = {}
        self.copies: list[tuple[str, torch.Tensor]] = []
        self.bad_shapes: list[str] = []

    def add(self, key: str, target: torch.Tensor, label: str) -> None:
        md = _tensor_meta(self.metadata, key)
        if md is None:
            raise _storage.CheckpointError(f"checkpoint {self.where}: {key!r} is not a tensor")
        if tuple(md.size) != tuple(target.shape):
            self.bad_shapes.append(f"{label}: checkpoint {tuple(md.size)} vs {tuple(target.shape)} ({key})")
            return
        if key in self.load:
            self.copies.append((key, target))
        else:
            self.load[key] = target

    def run(self, process_group: Any) -> None:
        if self.bad_shapes:
            raise _storage.CheckpointError(
                f"checkpoint {self.where}: shapes differ for {len(self.bad_shapes)} tensor(s):\n  "
                + "\n  ".join(self.bad_shapes)
            )
        with _single_process_is_intended():
            dcp.load(self.load, storage_reader=self.reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True), process_group=process_group)
        with torch.no_grad():
            for key, target in self.copies:
                target.copy_(self.load[key])


def _new_state_tensor(md: Any, p: torch.Tensor) -> torch.Tensor:
    dtype = md.properties.dtype
    if tuple(md.size) == tuple(p.shape):
        return torch.zeros_like(p, dtype=dtype)  # a DTensor param gets a DTensor sharded the same way
    return torch.zeros(tuple(md.size), dtype=dtype)


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
    folder = Path(path)
    if not folder.is_dir():
        hint = " (an unfinished save)" if _storage.partial_path(folder).is_dir() else ""
        raise _storage.CheckpointError(f"no checkpoint folder at {folder}{hint}")
    plain = _storage.read_plain(folder)
    if plain.get("format") != FORMAT:
        raise _storage.CheckpointError(f"{folder}: checkpoint format {plain.get('format')!r}, expected {FORMAT}")
    reader = _storage.SafeReader(folder)
    metadata = reader.read_metadata()
    _storage.check_files(folder, metadata)
    remap = remap or Remap()
    plan = _Plan(reader, metadata, str(folder))
    fresh: list[str] = []
    ignored: list[str] = []

    def match(targets: Sequence[str], sources: Sequence[str], what: str) -> dict[str, str]:
        mapping, missing, unexpected = remap.plan(targets, sources)
        if (missing or unexpected) and strict:
            raise _storage.CheckpointError(mismatch_message(f"{folder} ({what})", missing, unexpected))
        fresh.extend(missing + [t for t in targets if t not in mapping and t not in missing])
        ignored.extend(unexpected + [s for s in sources if remap.is_ignored(s) and s not in mapping.values()])
        return mapping

    # model
    targets = canonical_names(_module(model).state_dict().items(), "model")
    for t, s in match(list(targets), plain["model"], "model").items():
        plan.add(f"model/{s}", targets[t], t)
    # averaged model
    if averaged_model is not None:
        saved = [k[len("averaged/"):] for k in metadata.state_dict_metadata if k.startswith("averaged/")]
        if not saved:
            raise _storage.CheckpointError(f"checkpoint {folder} holds no averaged model (none was saved)")
        targets = canonical_names(averaged_model.state_dict().items(), "averaged_model")
        for t, s in match(list(targets), saved, "averaged model").items():
            plan.add(f"averaged/{s}", targets[t], f"averaged {t}")
    # optimizer: tensors to load into are created from the metadata (a fresh optimizer has no state yet)
    optim_state: dict[int, dict[str, Any]] = {}
    if optimizer is not None:
        saved_optim = plain.get("optimizer")
        if saved_optim is None:
            raise _storage.CheckpointError(f"checkpoint {folder} holds no optimizer state (none was saved)")
        saved_group_of = {n: gi for gi, g in enumerate(saved_optim["param_groups"]) for n in g["params"]}
        names = _param_names(model, optimizer)
        mapping = match([n for row in names for n in row], list(saved_group_of), "optimizer")
        state_keys: dict[str, list[str]] = {}
        for key in metadata.state_dict_metadata:
            if key.startswith("optim/"):
                name, _, sk = key[len("optim/"):].rpartition("/")
                state_keys.setdefault(name, []).append(sk)
        index = 0
        for row, g in zip(names, optimizer.param_groups):
            for t, p in zip(row, g["params"]):
                s = mapping.get(t)
                if s is not None:
                    entry: dict[str, Any] = dict(saved_optim["values"].get(s, {}))
                    for sk in state_keys.get(s, []):
                        key = f"optim/{s}/{sk}"
                        md = _tensor_meta(metadata, key)
                        entry[sk] = _new_state_tensor(md, p)
                        plan.add(key, entry[sk], f"optimizer state {sk!r} of {t}")
                    if entry:
                        optim_state[index] = entry
                index += 1
    # rng
    rank = _rank(process_group)
    saved_world = int(plain.get("world_size", 1))
    rng_targets: dict[str, torch.Tensor] = {}
    if restore_rng:
        src = rank % saved_world
        for kind, current in _rng_tensors().items():
            key = f"rng/{src}/{kind}"
            if _tensor_meta(metadata, key) is not None:
                rng_targets[kind] = torch.empty_like(current)
                plan.add(key, rng_targets[kind], f"rng {kind}")
    saved_schedulers = plain.get("schedulers", [])
    schedulers = _schedulers(schedulers)
    if schedulers and len(schedulers) != len(saved_schedulers):
        raise _storage.CheckpointError(
            f"checkpoint {folder} holds {len(saved_schedulers)} scheduler state(s); {len(schedulers)} given"
        )
    if grad_scaler is not None and plain.get("grad_scaler") is None:
        raise _storage.CheckpointError(f"checkpoint {folder} holds no grad scaler state (none was saved)")

    plan.run(process_group)

    if optimizer is not None:
        groups = []
        index = 0
        for row, g in zip(names, optimizer.param_groups):
            sources = [mapping[t] for t in row if t in mapping]
            saved = saved_optim["param_groups"][saved_group_of[sources[0]]] if sources else {}
            hyper = {k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS and k != "params"}
            new = {**{k: v for k, v in g.items() if k != "params"}, **hyper, "params": list(range(index, index + len(row)))}
            groups.append(new)
            index += len(row)
        optimizer.load_state_dict({"state": optim_state, "param_groups": groups})
        if hasattr(optimizer, "_load_in_backward_state"):
            optimizer._load_in_backward_state(saved_optim.get("in_backward") or {})
    for sched, state in zip(schedulers, saved_schedulers):
        sched.load_state_dict(state)
    if grad_scaler is not None:
        grad_scaler.load_state_dict(plain["grad_scaler"])
    if restore_rng:
        if "cpu" in rng_targets:
            torch.set_rng_state(rng_targets["cpu"])
        if "cuda" in rng_targets:
            torch.cuda.set_rng_state(rng_targets["cuda"])
        rng_plain = plain.get("rng") or []
        if rng_plain:
            _set_plain_rng(rng_plain[rank % len(rng_plain)])
    return LoadResult(folder, plain.get("step"), plain.get("extra") or {}, saved_world,
                      sorted(set(fresh)), sorted(set(ignored)))

"""The optimizer's part of a checkpoint: state tensors keyed by parameter name, hyperparameters per group.

Saved from the optimizer's own ``state`` and ``param_groups`` (so a standard ``torch.optim`` optimizer and an
:class:`~dist_optim.InBackwardOptimizer` write the same thing), and loaded through its ``load_state_dict`` with
state tensors created from the checkpoint's metadata (a fresh optimizer has no state yet).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engine._inputs import is_dtensor
from ..optimizer import InBackwardOptimizer
from . import _ranks, _reshard, _subclass_state
from ._names import canonical_names
from ._request import LoadRequest, SaveRequest
from ._storage import CheckpointError
from ._transfer import Snapshot, Source

__all__: list[str] = []

# How the current optimizer computes, not what it learned: kept from the optimizer being loaded into.
IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
# The key of ``state_dict()`` where InBackwardOptimizer keeps the plain data its next step needs (the previous
# norm of clip_mode="previous_norm"); a standard optimizer's ``load_state_dict`` ignores it.
IN_BACKWARD_KEY = "in_backward"
# The key, in each saved param group, of the class that stepped it: state and hyperparameters mean something only
# to that class.
OPTIMIZER_CLASS_KEY = "optimizer_class"


def param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The checkpoint name of every optimizer parameter, group by group."""
    names = {id(p): n for n, p in canonical_names(module.named_parameters(), "model").items()}
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


def group_classes(optimizer: torch.optim.Optimizer) -> list[str]:
    """The qualified name of the class that steps each param group: an InBackwardOptimizer's inner classes, else the
    optimizer's own class."""
    if isinstance(optimizer, InBackwardOptimizer):
        per_group = optimizer.optimizer_classes
    else:
        per_group = (type(optimizer),) * len(optimizer.param_groups)
    return [f"{c.__module__}.{c.__qualname__}" for c in per_group]


def _refuse_an_incomplete_step(req: SaveRequest, optimizer: torch.optim.Optimizer) -> None:
    """A backward that raised after some buckets stepped leaves layers one step apart: such a checkpoint would
    resume a state no training run ever had. Decided with every rank's flag, so all ranks raise together."""
    if req.force:
        return
    incomplete = isinstance(optimizer, InBackwardOptimizer) and optimizer.step_incomplete
    ranks = [r for r, flag in enumerate(_ranks.all_gather(incomplete, req.process_group)) if flag]
    if ranks:
        where = f" on ranks {ranks}" if _ranks.distributed(req.process_group) else ""
        raise CheckpointError(
            f"{req.path}: the optimizer's in-backward step is incomplete{where} (a backward raised or was "
            "interrupted after some buckets had stepped, so parameters are one step apart). Resume from the last "
            "checkpoint instead, or pass force=True to save this state anyway"
        )


def collect(req: SaveRequest, snap: Snapshot) -> None:
    optimizer = req.objects.optimizer
    if optimizer is None:
        return
    _refuse_an_incomplete_step(req, optimizer)
    names = param_names(req.objects.module, optimizer)
    groups, values = [], {}
    rank = _ranks.rank(req.process_group)
    # quantised states (torchao's tensor subclasses): their inner tensors, rebuilt as the same class on load
    subclass_states: dict[str, dict[str, Any]] = {}
    for group_names, g in zip(names, optimizer.param_groups):
        for name, p in zip(group_names, g["params"]):
            for key, v in optimizer.state.get(p, {}).items():
                if _subclass_state.is_subclass_state(v) or _subclass_state.local_subclass(v):
                    subclass_states.setdefault(name, {})[key] = _subclass_state.collect(name, key, v, rank,
                                                                                        snap.tensors)
    # every rank's description: a sharded (FSDP2) state keeps each rank's own shapes. Collective.
    merged = _subclass_state.merge(_ranks.all_gather(subclass_states, req.process_group))
    plain_shards: dict[str, dict[str, Any]] = {}
    for group_names, g, cls in zip(names, optimizer.param_groups, group_classes(optimizer)):
        for name, p in zip(group_names, g["params"]):
            for key, v in optimizer.state.get(p, {}).items():
                if key in subclass_states.get(name, {}):
                    continue
                if merged.get(name, {}).get(key, {}).get("layout") == "sharded":
                    # quantised on other ranks, plain here (a shard too small to quantise): stored with them
                    plain_shards.setdefault(name, {})[key] = _subclass_state.collect_plain_shard(
                        name, key, v, rank, snap.tensors)
                elif isinstance(v, torch.Tensor) and v.dim() > 0 or is_dtensor(v):
                    snap.tensors[f"optim/{name}/{key}"] = v
                elif isinstance(v, torch.Tensor):
                    snap.tensors[f"optim/{name}/{key}"] = v.detach().clone()  # scalar ("step"): a snapshot
                else:
                    values.setdefault(name, {})[key] = v
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": group_names,
                       OPTIMIZER_CLASS_KEY: cls})
    if _subclass_state.has_plain_shards(merged):  # the same on every rank. Collective.
        _subclass_state.merge_plain_shards(merged, _ranks.all_gather(plain_shards, req.process_group))
    saved = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "param_groups": groups,
             "values": values}
    if merged:
        saved[_subclass_state.PLAIN_KEY] = merged
    in_backward = optimizer.state_dict().get(IN_BACKWARD_KEY)
    if in_backward:
        saved[IN_BACKWARD_KEY] = in_backward
    snap.plain["optimizer"] = saved


def torchao_block_sizes(optimizer: torch.optim.Optimizer) -> list[int | None]:
    """Per param group, the block size of torchao's quantising Adam class that steps it (``None``: another class,
    or torchao's that never quantises): what decides which of its states torchao would quantise."""
    base = getattr(sys.modules.get("torchao.optim.adam"), "_AdamBase", None)
    in_backward = isinstance(optimizer, InBackwardOptimizer)
    classes = optimizer.optimizer_classes if in_backward else (type(optimizer),) * len(optimizer.param_groups)
    options = optimizer.optimizer_kwargs if in_backward else ({},) * len(classes)
    out: list[int | None] = []
    for cls, kwargs in zip(classes, options):
        if not (isinstance(base, type) and issubclass(cls, base)):
            out.append(None)
            continue
        if in_backward:
            # torchao keeps block_size on the instance, not in the groups: the class's constructor options (a
            # group with its own class takes the class's defaults)
            default = inspect.signature(cls).parameters.get("block_size")
            block = kwargs.get("block_size", getattr(default, "default", None))
        else:
            block = getattr(optimizer, "block_size", None)
        out.append(block if isinstance(block, int) and not isinstance(block, bool) else None)
    return out


def _check_plain(block: int, key: str, target: str, p: torch.Tensor, misfits: list[str],
                 layouts: list[tuple[_reshard.Layout, int | None]]) -> None:
    """A plain saved state of torchao's that this layout would quantise somewhere (the reverse of a quantised
    state cut into plain pieces): refused, as quantising it would change its values."""
    here = _reshard.target_of(p)
    if here is None:
        return  # a layout this module does not cut: the state loads as saved (plain) where its shapes allow
    shape = tuple(p.shape)
    lay = _reshard.Layout(shape, (_reshard.Piece(0, math.prod(shape), False, label="the saved state"),), None)
    layouts.append((lay, block))
    bad = _reshard.misfit(lay, here[0], block)
    if bad is not None:
        misfits.append(f"{key!r} of {target} (saved plain): {bad}")


def _new_state_tensor(md: Any, p: torch.Tensor) -> torch.Tensor:
    dtype = md.properties.dtype
    if tuple(md.size) == tuple(p.shape):
        return torch.zeros_like(p, dtype=dtype)  # a DTensor param gets a DTensor sharded the same way
    return torch.zeros(tuple(md.size), dtype=dtype)


def plan(req: LoadRequest, src: Source) -> Callable[[], None] | None:
    optimizer = req.objects.optimizer
    if optimizer is None:
        return None
    saved = src.required("optimizer", "optimizer state")
    saved_group_of = {n: gi for gi, g in enumerate(saved["param_groups"]) for n in g["params"]}
    names = param_names(req.objects.module, optimizer)
    mapping = src.match([n for row in names for n in row], list(saved_group_of), "optimizer")
    state_keys: dict[str, list[str]] = {}
    for key in src.saved_keys("optim/"):
        name, _, sk = key.rpartition("/")
        state_keys.setdefault(name, []).append(sk)
    subclass_states = saved.get(_subclass_state.PLAIN_KEY) or {}
    rank, world = _ranks.rank(req.process_group), _ranks.world(req.process_group)
    rebuilds: list[tuple[dict[str, Any], str, Callable[[], torch.Tensor]]] = []  # (entry, key, rebuild after read)
    misfits: list[str] = []  # torchao states this layout cannot hold exactly, refused together
    layouts: list[tuple[_reshard.Layout, int | None]] = []  # every torchao state's, with its block size: for the advice
    uncut = 0  # subclass states saved on a layout that is not cut (they load on it only): the advice leaves them out
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    blocks = torchao_block_sizes(optimizer)
    for gi, (row, g, cls) in enumerate(zip(names, optimizer.param_groups, group_classes(optimizer))):
        sources = [mapping[t] for t in row if t in mapping]
        saved_cls = saved["param_groups"][saved_group_of[sources[0]]].get(OPTIMIZER_CLASS_KEY) if sources else None
        if saved_cls is not None and saved_cls != cls:  # checkpoints from before the key was written: unchecked
            raise CheckpointError(
                f"{req.path}: param group {gi} was saved by {saved_cls} and would be loaded into {cls}: its state "
                "and hyperparameters mean nothing to another optimizer class. Build the optimizer with the saved "
                "class, or load the weights only (load(path, model=model) without optimizer=) and start the "
                "optimizer afresh"
            )
        for t, p in zip(row, g["params"]):
            s = mapping.get(t)
            if s is not None:
                entry: dict[str, Any] = dict(saved["values"].get(s, {}))
                for sk in state_keys.get(s, []):
                    key = f"optim/{s}/{sk}"
                    entry[sk] = _new_state_tensor(src.tensor_meta(key), p)
                    src.read_into(key, entry[sk], f"optimizer state {sk!r} of {t}")
                    if blocks[gi] is not None and sk in _reshard.BUFFER_KEYS:
                        _check_plain(blocks[gi], sk, t, p, misfits, layouts)
                for sk, saved_entry in subclass_states.get(s, {}).items():
                    lay = _subclass_state.layout(saved_entry, s, sk, src)
                    if lay is not None:
                        layouts.append((lay, blocks[gi] if blocks[gi] is not None else lay.block))
                    uncut += lay is None
                    try:
                        rebuilds.append((entry, sk, _subclass_state.plan(saved_entry, s, sk, t, p, rank, world, src,
                                                                         blocks[gi])))
                    except _subclass_state.Misfit as e:
                        misfits.append(str(e))
                    entry[sk] = None  # rebuilt after the read
                if entry:
                    state[index] = entry
            elif optimizer.state.get(p):
                state[index] = optimizer.state[p]  # a tensor the checkpoint lacks (strict=False) keeps its state
            index += 1
        saved_group = saved["param_groups"][saved_group_of[sources[0]]] if sources else {}
        hyper = {k: v for k, v in saved_group.items()
                 if k not in IMPLEMENTATION_KEYS and k not in ("params", OPTIMIZER_CLASS_KEY)}
        start = index - len(row)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, **hyper, "params": list(range(start, index))})
    if misfits:
        shown = misfits[:5] + ([f"... and {len(misfits) - 5} more"] if len(misfits) > 5 else [])
        where = (f"load exactly {_reshard.loadable(layouts, int(src.plain.get('world_size', 1)))}" if not uncut
                 else "load exactly on the saving job's layout only (some were saved on placements that are not cut)")
        raise CheckpointError(
            f"{req.path}: {len(misfits)} low-bit optimizer state(s) cannot be loaded exactly on this layout "
            f"({world} rank(s)); nothing was loaded:\n  " + "\n  ".join(shown) + "\nThe saved codes and scales "
            "could only be re-quantised (or de-quantised) to fill them, which changes the values. This checkpoint's "
            f"low-bit states {where}; or load the weights only (load(path, model=model)) and start the optimizer "
            "afresh"
        )
    state_dict: dict[str, Any] = {"state": state, "param_groups": groups}
    if saved.get(IN_BACKWARD_KEY):
        state_dict[IN_BACKWARD_KEY] = saved[IN_BACKWARD_KEY]

    def apply() -> None:
        for entry, sk, rebuild in rebuilds:
            entry[sk] = rebuild()
        optimizer.load_state_dict(state_dict)

    return apply

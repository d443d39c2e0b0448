"""One check at construction that every rank built its optimizer with the same options.

Different options across ranks (lr, optimizer class, clipping) let replicas drift apart silently, and clipping on
one rank only hangs in its collective until the process group times out. A short hash of the options is gathered
once; only on a mismatch are the options themselves gathered, to name the one that differs and the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from dist_optim.engine._classes import hyperparameters
from dist_optim.engine._inputs import is_dtensor

__all__: list[str] = []


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()})" if value.numel() <= 16 else f"tensor(shape={tuple(value.shape)})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__qualname__  # an object (a GradScaler): only its kind can be compared


# Options that change no result: how the step is cut into buckets, whether plain tensors may step locally (checked
# on each rank by itself), warnings raised as errors
_RESULT_NEUTRAL = ("bucket_cap_mb", "per_parameter", "allow_local_steps", "strict")


def options_of(opt: Any, optimizer_class: type) -> dict[str, str]:
    """The options that must agree across ranks (those that change the arithmetic or run a collective), as
    comparable strings, keyed by where they are set: the ``InBackwardOptions`` fields but those that change no
    result, and every group's class and hyperparameters."""
    options = {"optimizer_class": _describe(optimizer_class)}
    for f in dataclasses.fields(opt.options):
        if f.name not in _RESULT_NEUTRAL:
            options[f.name] = _describe(getattr(opt.options, f.name))
    for gi, (cls, group) in enumerate(zip(opt.optimizer_classes, opt.param_groups)):
        options[f"param_groups[{gi}].optimizer_class"] = _describe(cls)
        for key, value in sorted(hyperparameters(group).items()):
            options[f"param_groups[{gi}].{key}"] = _describe(value)
    return options


def sharding_groups(params: list[torch.Tensor]) -> list[Any]:
    """The process groups over which the DTensor ``params`` must agree: one per dimension of their device mesh (a
    2-D mesh, data parallel x tensor parallel or HSDP, may be a slice of a larger one, as a pipeline stage's is;
    ranks that agree along every dimension of the mesh agree across all of it). ``[None]`` (the default group) if
    none is a DTensor."""
    mesh = next((p.device_mesh for p in params if is_dtensor(p)), None)
    if mesh is None:
        return [None]
    return [_live_group(mesh, dim) for dim in range(mesh.ndim)]


def _live_group(mesh: Any, dim: int) -> Any:
    """``mesh.get_group(dim)``, checked to be a group of this process group that holds the mesh's ranks along
    ``dim``: a mesh of an earlier process group (torch's DTensor sharding cache hands it out again after
    ``destroy_process_group()`` and ``init_process_group()`` in one process) names groups that are gone, or that are
    other groups now, whose collectives hang or mix ranks."""
    names = getattr(mesh, "_dim_group_names", None)
    name = names[dim] if names and dim < len(names) else "?"
    try:
        group = mesh.get_group(dim)
    except RuntimeError as e:
        raise _stale_mesh(mesh, name, "which no longer exists") from e
    coordinate = mesh.get_coordinate()
    if coordinate is None or dist.get_backend(group) == "fake":
        return group
    index = list(coordinate)
    index[dim] = slice(None)
    want = mesh.mesh[tuple(index)].tolist()
    ranks = dist.get_process_group_ranks(group)
    if ranks != want:
        raise _stale_mesh(mesh, name, f"which holds ranks {ranks}, not the mesh's {want} along dimension {dim}")
    return group


def _stale_mesh(mesh: Any, name: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"the parameters' DeviceMesh {mesh} names process group {name!r}, {what}: it is a mesh of an earlier process "
        "group, which torch's DTensor sharding cache handed out again (meshes over the same ranks compare equal) "
        "after destroy_process_group() and init_process_group() in this process. Clear that cache when a process "
        "group is destroyed, with torch.distributed.tensor.debug._clear_sharding_prop_cache() before "
        "destroy_process_group(), and build the model again"
    )


def agreement_groups(ddp: Any, groups: list[Any]) -> list[Any]:
    """The process groups whose ranks must build the optimizer alike: DDP's group, or one per dimension of the
    DTensor parameters' mesh (``groups`` as ``param_groups_of`` gives them); ``[]`` for plain tensors."""
    if ddp is not None:
        return [ddp.process_group]
    tensors = [e[1] if isinstance(e, tuple) else e for g in groups if isinstance(g, dict) for e in g["params"]]
    if not any(is_dtensor(t) for t in tensors):
        return []
    return sharding_groups(tensors)


def check_same_options(opt: Any, groups: list[Any], optimizer_class: type) -> None:
    """Raise on every rank if some option differs across the ranks of any of ``groups`` (``None``: the default
    group), the dimensions of one device mesh: a rank whose own groups agree learns of a mismatch elsewhere.

    Collective: call on every rank of every group in ``groups``, once, at construction (or, on a rank whose
    construction raised before, :func:`announce_failure` in its place).
    """
    _agree(groups, options_of(opt, optimizer_class), failed=False)


def announce_failure(groups: list[Any], error: BaseException) -> None:
    """On a rank whose construction raised before :func:`check_same_options`, take part in its collectives with
    the error in place of the options, so that the other ranks raise too, naming this rank and its error, instead
    of waiting for it until the process group times out. The caller raises ``error`` again.

    Collective: call on every rank of every group in ``groups``, once, at construction.
    """
    _agree(groups, {_FAILED: f"{type(error).__name__}: {error}"}, failed=True)


# The key under which a rank whose construction raised sends its error in place of its options
_FAILED = "<raised>"


def _agree(groups: list[Any], options: dict[str, str], failed: bool) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    # a fake group (the memory planner's) has no other ranks to ask
    groups = [g for g in groups if dist.get_world_size(g) > 1 and dist.get_backend(g) != "fake"]
    if not groups:
        return
    digest = hashlib.sha256(repr(sorted(options.items())).encode()).hexdigest()[:16]
    mismatched = [g for g in groups if len(set(_gathered(digest, g))) > 1]
    if len(groups) > 1:  # along each dimension in turn: after the last one, every rank of the mesh knows
        anywhere = bool(mismatched)
        for g in groups:
            anywhere = any(_gathered(anywhere, g))
        if anywhere and not mismatched and not failed:
            raise ValueError(
                "InBackwardOptimizer was built with different options on other ranks of this device mesh, or "
                "raised there while it was built (those ranks name the option or the error), so the replicas "
                "would drift apart; build it with the same options on every rank"
            )
    lines: list[str] = []
    raised: dict[str, list[int]] = {}
    for g in mismatched:  # in the order of the mesh's dimensions on every rank: no two ranks wait on each other
        every = _gathered(options, g)
        for rank, o in enumerate(every):
            if _FAILED in o:
                raised.setdefault(o[_FAILED], []).append(rank if g is None else dist.get_global_rank(g, rank))
        if raised:  # a rank that raised is what to report; which options differ from its, it could not say
            continue
        keys = sorted(set().union(*every), key=lambda k: (k.startswith("param_groups"), k))
        for key in keys:
            values = [o.get(key, "<missing>") for o in every]
            if len(set(values)) > 1:
                by_value: dict[str, list[int]] = {}
                for rank, v in enumerate(values):
                    by_value.setdefault(v, []).append(rank if g is None else dist.get_global_rank(g, rank))
                lines.append(f"{key}: " + "; ".join(f"{v} on ranks {r}" for v, r in by_value.items()))
    if failed:
        return  # the caller raises its own error
    if raised:
        raise RuntimeError(
            "InBackwardOptimizer raised on other ranks while it was built, so this rank stops too instead of "
            "waiting for them in a collective: " + " | ".join(f"ranks {sorted(set(r))}: {e}" for e, r in
                                                              raised.items())
        )
    if mismatched:
        raise ValueError(
            "InBackwardOptimizer was built with different options on different ranks, so the replicas would drift "
            "apart (or a clipping collective would wait forever): " + " | ".join(dict.fromkeys(lines))
            + ". Build it with the same options on every rank"
        )


def _gathered(value: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out

"""One check at construction that every rank built its optimizer with the same options.

Different options across ranks (lr, optimizer class, clipping) let replicas drift apart silently, and clipping on
one rank only hangs in its collective until the process group times out. A short hash of the options is gathered
once; only on a mismatch are the options themselves gathered, to name the one that differs and the ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from dist_optim._inputs import is_dtensor
from dist_optim._stepper import hyperparameters

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


def options_of(opt: Any, accumulation_steps: int) -> dict[str, str]:
    """The options that must agree across ranks (those that change the arithmetic or run a collective), as
    comparable strings, keyed by where they are set. Bucketing is left out: it changes no result."""
    options = {
        "optimizer_class": _describe(opt._optimizer_class),
        "accumulation_steps": _describe(accumulation_steps),
    }
    for name, value in opt._policy_options.items():
        options[name] = _describe(value)
    for gi, (cls, group) in enumerate(zip(opt._recipe.classes, opt.param_groups)):
        options[f"param_groups[{gi}].optimizer_class"] = _describe(cls)
        for key, value in sorted(hyperparameters(group).items()):
            options[f"param_groups[{gi}].{key}"] = _describe(value)
    return options


def sharding_group(params: list[torch.Tensor]) -> Any:
    """The process group across which the DTensor ``params`` are sharded: their 1-D mesh's (FSDP2 over a slice of
    a larger mesh, as a pipeline stage of pipeline x FSDP2 is), else ``None`` (the default group)."""
    mesh = next((p.device_mesh for p in params if is_dtensor(p)), None)
    return mesh.get_group() if mesh is not None and mesh.ndim == 1 else None


def check_same_options(opt: Any, group: Any, accumulation_steps: int) -> None:
    """Raise on every rank if some option differs across the ranks of ``group`` (``None``: the default group).

    Collective: call on every rank of ``group``, once, at construction.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    options = options_of(opt, accumulation_steps)
    digest = hashlib.sha256(repr(sorted(options.items())).encode()).hexdigest()[:16]
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    every: list[Any] = [None] * len(digests)
    dist.all_gather_object(every, options, group=group)
    keys = sorted(set().union(*every), key=lambda k: (k.startswith("param_groups"), k))
    lines = []
    for key in keys:
        values = [o.get(key, "<missing>") for o in every]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(v, []).append(rank)
            lines.append(f"{key}: " + "; ".join(f"{v} on ranks {r}" for v, r in by_value.items()))
    raise ValueError(
        "InBackwardOptimizer was built with different options on different ranks, so the replicas would drift "
        "apart (or a clipping collective would wait forever): " + " | ".join(lines)
        + ". Build it with the same options on every rank"
    )

"""Who does what in a checkpoint collective: rank, world size, "run on rank 0 and tell everyone", barriers.

Both :mod:`._api` and :mod:`._manager` coordinate ranks the same way; a job without a process group (or with one
rank) is a world of one, so every helper here also works in a plain single-process script.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__: list[str] = []

T = TypeVar("T")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def distributed(group: Any) -> bool:
    """More than one rank takes part, so collectives are needed."""
    return initialized() and dist.get_world_size(group) > 1


def rank(group: Any) -> int:
    return dist.get_rank(group) if initialized() else 0


def world(group: Any) -> int:
    return dist.get_world_size(group) if initialized() else 1


def is_rank0(group: Any) -> bool:
    return rank(group) == 0


def on_rank0(fn: Callable[[], T], group: Any) -> T:
    """Run ``fn`` on rank 0; every rank returns its result or raises its exception. Collective."""
    result: list[Any] = [None, None]
    if is_rank0(group):
        try:
            result = [fn(), None]
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank below
            result = [None, e]
    if distributed(group):
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(result, src=src, group=group)
    if result[1] is not None:
        raise result[1]
    return result[0]


def all_gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` in a world of one). Collective."""
    if not distributed(group):
        return [value]
    out: list[Any] = [None] * world(group)
    dist.all_gather_object(out, value, group=group)
    return out


def barrier(group: Any) -> None:
    if distributed(group):
        dist.barrier(group=group)

"""FSDP2 for the memory planner: one rank of a ``fully_shard`` job, traced on fake tensors over torch's fake process
group (``FakeStore``, ``init_process_group("fake")``), which runs FSDP2's own code: the sharded parameters,
gradients and state, the all-gather buffers and unsharded parameters of the units being computed, the
reduce-scatter inputs and outputs. Its collectives complete at once and allocate nothing.

FSDP2 allocates and frees the unsharded parameters by resizing their storages (``UntypedStorage.resize_``), which
no operator reports: :func:`following_resizes` wraps that method while a trace runs, and restores it after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._memory_trace import MemoryTrace

__all__: list[str] = []


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process rank 0) and a 1-D CPU mesh over it; destroyed
    after."""
    from torch.distributed.device_mesh import init_device_mesh

    from dist_optim._torch_internals import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: the mesh's tensors are real
    finally:
        dist.destroy_process_group()


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard``-ed before the root: the entries of the ``nn.ModuleList`` holding the most
    parameters (a transformer's blocks: ``model.blocks``, ``model.model.layers``)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def shard(model: nn.Module, mesh: Any, units: Callable[[nn.Module], list[nn.Module]] | None) -> nn.Module:
    """``fully_shard`` each unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for unit in (units or default_units)(model):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def following_resizes(trace: MemoryTrace) -> Iterator[None]:
    """Count ``UntypedStorage.resize_`` in ``trace`` while inside (FSDP2's unsharded parameters)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
        out = original(storage, nbytes)
        trace.resized(storage, int(nbytes))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t

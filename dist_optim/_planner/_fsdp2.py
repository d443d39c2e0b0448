"""FSDP2 for the memory planner: one rank of a ``fully_shard`` job, traced on fake tensors over torch's fake process
group (``FakeStore``, ``init_process_group("fake")``), which runs FSDP2's own code: the sharded parameters,
gradients and state, the all-gather buffers and unsharded parameters of the units being computed, the
reduce-scatter inputs and outputs. Its collectives complete at once.

FSDP2 allocates and frees the unsharded parameters by resizing their storages, which no operator reports: the trace
follows the storages FSDP2 resizes (``fsdp_resized_tensors``, read from FSDP2's parameters), re-reading their sizes at
every operator. The fake group's collectives allocate nothing; a real backend's may: :func:`collective_buffers` is
what gloo allocates inside FSDP2's all-gather and reduce-scatter (measured, docs/planning.md), counted for the
collective's duration, and nothing for NCCL (whose buffers are not torch's allocator's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._torch_internals import clear_sharding_cache, fake_store, fsdp_collective_ops

__all__: list[str] = []


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process rank 0) and a 1-D CPU mesh over it; destroyed
    after."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: the mesh's tensors are real
    finally:
        clear_sharding_cache()  # no fake mesh handed to a later job (_torch_internals)
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


BACKENDS = ("gloo", "nccl")  # the backends whose collectives' buffers are planned


def collective_buffers(backend: str | None) -> Callable[[Any, tuple[Any, ...]], int]:
    """The bytes ``backend`` allocates inside a collective operator, for its duration (``None``: by the device of
    the collective's tensors, gloo on CPU, NCCL on CUDA). Gloo (measured on 2 ranks, docs/planning.md):
    ``all_gather_into_tensor`` gathers into a flat output of its own, then copies it into the one it is given (the
    output's bytes); ``reduce_scatter_tensor`` reduces a copy of its input (the input's bytes). NCCL: nothing
    through torch's allocator."""
    all_gather, reduce_scatter = fsdp_collective_ops()
    which = {all_gather: 0, reduce_scatter: 1}  # the argument whose bytes gloo copies: output, input

    def nbytes(func: Any, args: tuple[Any, ...]) -> int:
        i = which.get(func)
        if i is None:
            return 0
        t = args[i]
        if (backend or ("nccl" if t.device.type == "cuda" else "gloo")) != "gloo":
            return 0
        return t.numel() * t.element_size()

    return nbytes


def not_seen(backend: str) -> tuple[str, ...]:
    """What a rank of an FSDP2 layout holds beyond the plan on ``backend``, with its measured size
    (docs/planning.md)."""
    if backend == "nccl":
        return ("NCCL's own buffers (its channels' memory, allocated outside torch's allocator) are not planned, and "
                "not measured here",)
    return ("gloo's buffers inside FSDP2's collectives are planned for each collective's duration (communication: "
            "the all-gather's flat output, the reduce-scatter's copy of its input), but gloo frees some late, on its "
            "own thread, after the collective returned: on 2 and 2 x 2 gloo ranks 86 of 780 measured steps (0 to 9 "
            "of 15 per rank and loop) peaked 0.5 to 8.0 MiB above the plan, never more than the communication term "
            "again: leave that headroom",)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t

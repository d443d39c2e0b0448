"""Tensor parallel, FSDP2 x TP and HSDP for the memory planner: one representative rank (rank 0) of the job, traced
on fake tensors over torch's fake process group and a fake device mesh, running DTensor's and FSDP2's own code.

``tp``: the user's ``parallelize(model, mesh)`` on a 1-D ``("tp",)`` mesh of every rank. ``fsdp2+tp``: a
``("dp", "tp")`` mesh of ``(world_size / tp_size, tp_size)``, ``parallelize`` on "tp", then ``fully_shard`` per unit
and the root on "dp" (torchtitan's order). ``hsdp``: a ``("replicate", "shard")`` mesh of ``(world_size /
shard_size, shard_size)``, ``fully_shard`` per unit and the root on it. The collectives complete at once;
DTensor's redistributions allocate their outputs, which the trace sees, and gloo's buffers inside FSDP2's collectives
are added as on an FSDP2 rank (``_plan_fsdp2.collective_buffers``).

A device mesh keeps its ranks in a real integer tensor and recomputes sub-meshes from it (FSDP2 over a TP mesh
concatenates them): :class:`RealMeshOps` runs an operator whose tensors are all real (they can only be a mesh's)
outside ``FakeTensorMode``, where it would otherwise refuse them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._torch_internals import (
    TorchDispatchMode,
    clear_sharding_cache,
    fake_store,
    tree_iter,
    unset_fake_temporarily,
)

__all__: list[str] = []

TENSOR_PARALLEL = ("tp", "fsdp2+tp")  # the layouts that call the user's parallelize(model, mesh)
# What a TP rank holds that the plan does not see, measured on gloo (benchmarks/bench_plan_layouts.py,
# docs/planning.md); FSDP2 x TP and HSDP: _plan_fsdp2.not_seen
NOT_SEEN = (("tensor parallel's collectives: DTensor's redistributions allocate their outputs, which the plan holds; "
             "on 2 gloo ranks the collectives allocated nothing beside them (measured, every thread: 0 bytes); "
             "NCCL's own buffers are not measured"),)


def check(parallel: str, world_size: int, tp_size: int | None, shard_size: int | None,
          parallelize: Callable[[nn.Module, Any], Any] | None, engine: dict[str, Any]) -> None:
    """Refuse a layout of this module that cannot be planned, naming the value and the fix."""
    if parallel in TENSOR_PARALLEL and not callable(parallelize):
        raise ValueError(f"parallel={parallel!r} needs parallelize, a callable parallelize(model, mesh) that applies "
                         "the model's tensor-parallel plan on the 1-D tensor-parallel mesh (parallelize_module with "
                         f"ColwiseParallel, RowwiseParallel, ...), got {parallelize!r}")
    if parallel == "hsdp" and parallelize is not None:
        raise NotImplementedError("parallelize with parallel='hsdp' (HSDP x TP) is not planned; give parallel="
                                  "'fsdp2+tp' for FSDP2 over a tensor-parallel model")
    if parallel != "hsdp" and shard_size is not None:
        raise ValueError(f"shard_size={shard_size} applies to parallel='hsdp' only, got parallel={parallel!r}")
    if parallel == "tp":
        if world_size < 2:
            raise ValueError(f"parallel='tp' needs world_size >= 2 (the tensor-parallel ranks), got {world_size}")
        if tp_size is not None and tp_size != world_size:
            raise ValueError(f"parallel='tp' runs one TP rank per process: tp_size must be None or world_size "
                             f"({world_size}), got {tp_size}; give parallel='fsdp2+tp' for a 2-D mesh")
    elif parallel == "fsdp2+tp":
        if tp_size is None or tp_size < 2 or world_size % tp_size or tp_size >= world_size:
            raise ValueError(f"parallel='fsdp2+tp' needs tp_size, at least 2, a divisor of world_size ({world_size}) "
                             f"below it (a (world_size / tp_size, tp_size) mesh), got {tp_size}")
    elif parallel == "hsdp" and (shard_size is None or shard_size < 1 or world_size % shard_size
                                 or shard_size >= world_size):
        raise ValueError(f"parallel='hsdp' needs shard_size, the ranks each replica is sharded over: a divisor of "
                         f"world_size ({world_size}) below it (a (world_size / shard_size, shard_size) mesh), got "
                         f"{shard_size}")
    if engine.get("accumulation_steps", 1) > 1:
        raise NotImplementedError(f"accumulation_steps > 1 with parallel={parallel!r} is not planned yet (not "
                                  "validated against a measurement)")


def mesh_shape(parallel: str, world_size: int, tp_size: int | None, shard_size: int | None
               ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh's shape and dimension names."""
    if parallel == "tp":
        return (world_size,), ("tp",)
    if parallel == "fsdp2+tp":
        assert tp_size is not None
        return (world_size // tp_size, tp_size), ("dp", "tp")
    assert shard_size is not None
    return (world_size // shard_size, shard_size), ("replicate", "shard")


@contextlib.contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[Any]:
    """A fake process group of ``prod(shape)`` ranks (this process rank 0) and a CPU mesh over it; destroyed after."""
    from torch.distributed.device_mesh import init_device_mesh

    world = 1
    for n in shape:
        world *= n
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)  # outside FakeTensorMode: its tensors are real
    finally:
        clear_sharding_cache()  # no fake mesh handed to a later job (_torch_internals)
        dist.destroy_process_group()


def wrap(model: nn.Module, mesh: Any, parallel: str, parallelize: Callable[[nn.Module, Any], Any] | None,
         units: Callable[[nn.Module], list[nn.Module]] | None) -> nn.Module:
    """``model`` laid out as ``parallel`` on ``mesh``: the tensor-parallel plan, then FSDP2 where the layout has it."""
    from dist_optim._planner._fsdp2 import shard

    if parallel in TENSOR_PARALLEL:
        assert parallelize is not None
        tp_mesh = mesh["tp"]
        out = parallelize(model, tp_mesh)
        model = out if isinstance(out, nn.Module) else model  # parallelize_module returns the module; others None
        _check_one_kind(model, parallel)
        if parallel == "tp":
            return model
        return shard(model, mesh["dp"], units)
    return shard(model, mesh, units)  # hsdp: fully_shard on the 2-D mesh


def _check_one_kind(model: nn.Module, parallel: str) -> None:
    """Plain parameters next to DTensors: the standard loop's fused or foreach kernel refuses the mix, and
    ``InBackwardOptimizer`` steps them only with ``allow_local_steps`` (no reduction): not planned."""
    plain = [n for n, p in model.named_parameters() if p.requires_grad and not hasattr(p, "placements")]
    if plain and len(plain) < sum(1 for p in model.parameters() if p.requires_grad):
        shown = ", ".join(plain[:4]) + (f", ... ({len(plain)} in all)" if len(plain) > 4 else "")
        raise NotImplementedError(
            f"parallel={parallel!r}: parallelize left plain parameters next to DTensor ones ({shown}); make them "
            "replicated DTensors (distribute_module with Replicate, as launch.tensor_parallel.tensor_parallel does, "
            "or SequenceParallel for norms)")


class RealMeshOps(TorchDispatchMode):
    """Runs an operator whose tensor arguments are all real, plain tensors outside ``FakeTensorMode`` (pushed above
    it): a device mesh's rank tensors, which FSDP2 over a TP mesh slices and concatenates. Any operator with a fake
    tensor, or with no tensor at all (a factory), goes on to ``FakeTensorMode``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(type(t) is torch.Tensor for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


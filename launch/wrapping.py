"""The run's layout: which ``--parallel`` a run takes, the model wrapped for it, and one micro-batch's sync context.

Above ``runtime`` (the process group, signals, errors) and ``tensor_parallel`` (the TP plan), which it uses.
"""

from __future__ import annotations

import contextlib

from torch import nn

from .runtime import LaunchError, Runtime
from .tensor_parallel import parallelize

__all__: list[str] = []


def resolve_parallel(parallel: str, rt: Runtime) -> str:
    if parallel == "auto":
        return "fsdp2" if rt.world > 1 else "none"
    if parallel == "none" and rt.world > 1:
        raise LaunchError(
            f"--parallel none with {rt.world} processes would train {rt.world} unrelated models; use fsdp2 or ddp"
        )
    if parallel != "none" and not rt.distributed:
        raise LaunchError(f"--parallel {parallel} needs a process group: launch with torchrun")
    return parallel


def wrap(model: nn.Module, parallel: str, rt: Runtime, tp_size: int = 0) -> nn.Module:
    """``model`` on the run's device, wrapped for ``parallel`` (``fsdp2``: each block, then the root; ``tp``,
    ``fsdp2+tp``: :func:`launch.tensor_parallel.parallelize` over ``tp_size`` ranks)."""
    model.to(rt.device)
    if parallel in ("tp", "fsdp2+tp"):
        return parallelize(model, parallel, rt, tp_size)
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(rt.device.type, (rt.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if parallel == "ddp":
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def sync_context(model: nn.Module, parallel: str, last: bool):
    """The context of one micro-batch's backward: gradient reduction only on the last micro-batch."""
    if parallel == "ddp" and not last:
        return model.no_sync()
    if parallel in ("fsdp2", "fsdp2+tp"):
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()

"""Where the run executes: process group, device and threads from torchrun's environment, and the model wrapper.

CPU processes talk over gloo; when CUDA is present each process takes ``cuda:LOCAL_RANK`` and NCCL. Without
torchrun's variables the run is a single plain process with no process group.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LaunchError", "Runtime", "TermSignal", "start", "stop", "wrap"]


class LaunchError(ValueError):
    """A setting this run refuses; the entry point prints it as one line and exits with code 2."""


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj):
        """Every rank's ``obj``, in rank order. Collective: call on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a 0-d tensor over ranks. Collective: call on every rank."""
        if self.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world
        return value


class TermSignal:
    """Notes SIGTERM, which schedulers send some seconds before they kill a job, so that the run stops at a step
    boundary instead of dying mid-step. Use as a context manager (main thread); the previous handler comes back."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> TermSignal:
        self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _note(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed(self, rt: Runtime) -> bool:
        """Whether any rank has received SIGTERM: the signal reaches ranks at different steps (or only some of
        them), so every rank stops after the same step. Collective: call on every rank at the same step."""
        if not rt.distributed:
            return self.received
        flag = torch.tensor(int(self.received), device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def start(device: str, threads: int) -> Runtime:
    """Join torchrun's process group (if launched by torchrun) and pick the device. Collective."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise LaunchError("device cuda was asked for, but torch sees no CUDA device")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    if launched:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None,
                                timeout=datetime.timedelta(minutes=10))
    return Runtime(rank, world, local_rank, dev, launched)


def stop(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        # Models and reducers that still hold the process group (through reference cycles) are freed now, not at
        # interpreter exit, where a gloo thread still running aborts the process.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


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
        from .tensor_parallel import parallelize

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

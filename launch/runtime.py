"""Where the run executes: process group, device and threads from torchrun's environment, signals, errors.

CPU processes talk over gloo; when CUDA is present each process takes ``cuda:LOCAL_RANK`` and NCCL. Without
torchrun's variables the run is a single plain process with no process group.
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LaunchError", "Runtime", "TermSignal", "start", "stop"]


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
    """Notes SIGTERM, which schedulers send some seconds before they kill a job, and a first Ctrl-C (SIGINT), so that
    the run stops at a step boundary with a checkpoint instead of dying mid-step; a second Ctrl-C aborts at once
    (``KeyboardInterrupt``). Use as a context manager (main thread); the previous handlers come back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool = True) -> None:
        self.received: str | None = None  # the first signal's name
        self.announce = announce  # whether this process says what a Ctrl-C does (rank 0)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> TermSignal:
        self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _note(self, signum: int, frame: Any) -> None:
        first = self.received is None
        if signum == signal.SIGINT and not first:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: abort now, without the checkpoint
        # noted before the announcement: a second Ctrl-C may run this handler again in the middle of the print
        self.received = self.received or ("Ctrl-C" if signum == signal.SIGINT else "SIGTERM")
        if first and signum == signal.SIGINT and self.announce:
            print("\nCtrl-C: stopping after this step with a checkpoint (press Ctrl-C again to abort at once)",
                  file=sys.stderr, flush=True)

    def agreed(self, rt: Runtime) -> bool:
        """Whether any rank has received SIGTERM or a Ctrl-C: the signal reaches ranks at different steps (or only some of
        them), so every rank stops after the same step. Collective: call on every rank at the same step."""
        if not rt.distributed:
            return self.received is not None
        flag = torch.tensor(int(self.received is not None), device=rt.device)
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


def stop(rt: Runtime, failed: bool = False) -> None:
    """Leave the process group. ``failed``: this rank raised, and the others may be waiting for it in a collective:
    no barrier, which would wait for them as long as the group's timeout (10 minutes) before the error is shown;
    its group destroyed, their collectives fail, and torchrun ends the job."""
    if rt.distributed and dist.is_initialized():
        # Models and reducers that still hold the process group (through reference cycles) are freed now, not at
        # interpreter exit, where a gloo thread still running aborts the process.
        gc.collect()
        if not failed:
            dist.barrier()
        # a next job in this process (the tests run several) would get this job's device meshes from DTensor's
        # cache (meshes over the same ranks compare equal), and with them groups that are gone or are others.
        # Imported here: its package imports torch._dynamo (0.5 s of start-up that a TP or single-process run
        # would not otherwise pay)
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        dist.destroy_process_group()

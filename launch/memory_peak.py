"""The allocator's peak during one call, the meter the benchmarks and ``launch.train --compare`` both read.

CPU: torch.profiler's ``[memory]`` events (the allocator's signed deltas) summed in time order, for the profiled
thread; CUDA: ``torch.cuda.max_memory_allocated``. It lives here, in the runnable programs, so that ``launch``
needs nothing from ``benchmarks``; the benchmarks import it (as they import ``launch.gpt``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocator_peak", "quiet_kineto"]


PHASE = "phase: "  # the prefix of the record_function ranges a timeline reports as phases


def allocator_peak(fn: Callable[[], Any], device: torch.device | str = "cpu", *,
                   timeline: bool = False) -> dict[str, Any]:
    """The allocator's peak above its starting point during one call of ``fn``, and its net change (bytes).

    CPU: the ``[memory]`` events of ``torch.profiler.profile(profile_memory=True)`` (signed sizes) summed in time
    order; exact, but for the profiled thread only. CUDA: ``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats`` (every thread of the process). ``timeline=True`` adds ``(seconds, bytes)`` points
    of the running sum (the profiler runs on CUDA too then). To keep what ``fn`` returns, let it store it.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    prof = None
    with contextlib.ExitStack() as stack:
        if not cuda or timeline:
            stack.enter_context(quiet_kineto(os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "err")))
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = stack.enter_context(profile(activities=acts, profile_memory=True))
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    out: dict[str, Any] = {"source": "torch.profiler"}
    if prof is not None:
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == kind)
        running = peak = 0
        points = [(0.0, 0)]
        for t, n in events:
            running += n
            peak = max(peak, running)
            points.append(((t - events[0][0]) / 1e9, running))
        out.update(peak_bytes=peak, net_bytes=running, events=len(events))
        if timeline:
            out["timeline"] = points
            start = events[0][0] if events else 0
            out["phases"] = sorted(  # the ranges fn marked with record_function(PHASE + name), in seconds
                (e.name()[len(PHASE):], (e.start_ns() - start) / 1e9, (e.start_ns() + e.duration_ns() - start) / 1e9)
                for e in prof.profiler.kineto_results.events() if e.name().startswith(PHASE))
    if cuda:
        out.update(source="torch.cuda", peak_bytes=torch.cuda.max_memory_allocated(device) - base,
                   net_bytes=torch.cuda.memory_allocated(device) - base)
    return out


_KINETO_NOISE = re.compile(r"USDT:.*ActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)")


@contextlib.contextmanager
def quiet_kineto(path: str) -> Iterator[None]:
    """Kineto writes two lines to fd 2 for every profiled call: hold fd 2 in a file, pass on the rest at the end."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            sys.stderr.write("".join(ln for ln in f.read().decode(errors="replace").splitlines(keepends=True)
                                     if not _KINETO_NOISE.search(ln)))

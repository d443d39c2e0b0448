"""What CPU convolution kernels allocate inside themselves (oneDNN's reorders into its blocked layouts: up to 9 MiB on
one bf16 convolution of a small ResNet), which no operator returns and a dispatch trace cannot see: calibrated.

Each distinct convolution (operator, shapes, strides, dtypes, arguments) of the traced step is run once for real, at
the planned shape, on random tensors, and the allocator's peak inside it above its outputs (``torch.profiler``'s
memory events) is the workspace the trace holds for that operator's duration (``workspaces`` in the breakdown).
Where the operands would take more than ``LIMIT_BYTES``, the convolution is run on a batch cut to fit and its
workspace scaled by the batch (oneDNN's reorders hold whole operands: linear in the batch), said in ``not_seen``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from dist_optim._torch_internals import tree_iter, unset_fake_temporarily

__all__: list[str] = []

logger = logging.getLogger(__name__)

LIMIT_BYTES = 256 * 2**20  # the most bytes of real operands a calibration allocates
_OPS = ("aten::convolution", "aten::convolution_backward")  # on CPU; CUDA's cuDNN workspaces: not calibrated


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """The profiler's native library writes lines on fd 2 for every profiled call: held in a file, dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _real(t: torch.Tensor, batch: int | None) -> torch.Tensor:
    shape = list(t.shape)
    if batch is not None and shape:
        shape[0] = batch
    out = torch.empty(shape, dtype=t.dtype)
    return out.normal_() if out.is_floating_point() else out.zero_()


def _peak_inside(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The allocator's peak during ``func`` above its outputs (bytes)."""
    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*args, **kwargs)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    running = peak = 0
    for _, n in events:
        running += n
        peak = max(peak, running)
    outputs = sum(t.untyped_storage().nbytes() for t in tree_iter(out) if isinstance(t, torch.Tensor))
    return max(0, peak - outputs)


class Workspaces:
    """``workspace(func, args, kwargs)``: the bytes a CPU convolution allocates inside itself (0 for any other
    operator), calibrated once per distinct call; ``scaled`` counts those measured on a cut batch."""

    def __init__(self) -> None:
        self._known: dict[Any, int] = {}
        self.scaled = 0
        self.most = 0  # the largest workspace calibrated

    def said(self) -> tuple[str, ...]:
        """The calibration, for the plan's ``not_seen`` (nothing when no convolution ran)."""
        if not self._known:
            return ()
        scaled = f"; {self.scaled} of them on a batch cut to fit, scaled by the batch" if self.scaled else ""
        return (f"CPU convolutions' own allocations, not traced but calibrated: {len(self._known)} distinct "
                f"convolutions run once for real at the planned shape, the most {self.most / 2**20:.1f} MiB, held "
                f"for each one's duration (workspaces){scaled}",)

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if func.name() not in _OPS or not all(t.device.type == "cpu" for t in tree_iter(args)
                                              if isinstance(t, torch.Tensor)):
            return 0
        key = (func, tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else
                           (tuple(a) if isinstance(a, list) else a) for a in args))
        if key not in self._known:
            self._known[key] = self._calibrate(func, args, kwargs)
            self.most = max(self.most, self._known[key])
        return self._known[key]

    def _calibrate(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        full = tensors[0].shape[0] if tensors[0].dim() else 1
        batch = max(1, full * LIMIT_BYTES // max(1, nbytes)) if nbytes > LIMIT_BYTES else None
        if batch is not None:
            self.scaled += 1
        logger.info("running %s once for real on %s to calibrate what it allocates inside%s", func.name(),
                    " x ".join(str(tuple(t.shape)) for t in tensors), "" if batch is None else f" (batch {batch})")
        # the batch dimension is the first of the operands that carry one: the input, and the output's gradient
        batched = {0, 1} if func.name() == "aten::convolution_backward" else {0}
        with unset_fake_temporarily(), torch.no_grad():
            real = tuple(_real(a, batch if i in batched else None) if isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
            measured = _peak_inside(func, real, kwargs)
        return measured if batch is None else measured * full // batch

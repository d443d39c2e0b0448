"""What CPU convolution kernels allocate inside themselves (oneDNN's reorders into its blocked layouts: up to 9 MiB on
one bf16 convolution of a small ResNet), which no operator returns and a dispatch trace cannot see: calibrated.

Each distinct convolution (operator, shapes, strides, dtypes, arguments) of the traced step is run once for real, at
the planned shape, on random tensors, and the allocator's peak inside it above its outputs (``torch.profiler``'s
memory events) is the workspace the trace holds for that operator's duration (``workspaces`` in the breakdown).
Where the operands would take more than ``LIMIT_BYTES``, the convolution is run on a batch cut to fit and its
workspace scaled by the batch (oneDNN's reorders hold whole operands: linear in the batch), said in ``not_seen``.

What a kernel keeps *after* it returns, outside torch's allocator (oneDNN's JIT kernels and primitive cache, MKL's
buffers), is read around the first real run of each distinct convolution and CPU matrix product (``_outside``'s
meter; matrix products on their rows cut to ``MATMUL_LIMIT_BYTES``, none larger run): the plan's ``outside torch's
allocator`` line. It is the kernels' first run in this process that shows it, so the figures are kept per process
(a second plan reuses them); a kernel the process ran before planning shows nothing.
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

from dist_optim._planner import _outside
from dist_optim._torch_internals import tree_iter, unset_fake_temporarily

__all__: list[str] = []

logger = logging.getLogger(__name__)

LIMIT_BYTES = 256 * 2**20  # the most bytes of real operands a calibration allocates
_OPS = ("aten::convolution", "aten::convolution_backward")  # on CPU; CUDA's cuDNN workspaces: not calibrated
# matrix products whose kernels (MKL, oneDNN in reduced precision) keep memory outside torch's allocator; the operands
# cut along the rows (the batch of bmm) are the first and, where it has them too, the added one
_MATMULS = {"aten::mm": (0,), "aten::addmm": (0, 1), "aten::bmm": (0, 1), "aten::baddbmm": (0, 1, 2)}
MATMUL_LIMIT_BYTES = 4 * 2**20  # the most bytes of real operands and output a matrix product's calibration allocates
_KEPT: dict[Any, int] = {}  # what each distinct kernel kept outside torch's allocator, measured once per process


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


def _key(func: Any, args: tuple[Any, ...]) -> Any:
    return (func, tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else
                        (tuple(a) if isinstance(a, list) else a) for a in args))


def _kept_outside(run: Any) -> int:
    """What ``run()`` (which makes and frees its own tensors) leaves allocated outside torch's allocator."""
    before = _outside.outside_bytes()
    run()
    return max(0, _outside.outside_bytes() - before)


class Workspaces:
    """``workspace(func, args, kwargs)``: the bytes a CPU convolution allocates inside itself (0 for any other
    operator), calibrated once per distinct call; ``scaled`` counts those measured on a cut batch. Along the way,
    what each distinct convolution and matrix product keeps outside torch's allocator (``outside_bytes``)."""

    def __init__(self) -> None:
        self._known: dict[Any, int] = {}
        self.scaled = 0
        self.most = 0  # the largest workspace calibrated
        self._outside: dict[Any, int] = {}  # the kernels' keys this plan met -> what each kept outside
        self.too_large = 0  # matrix products not run: above MATMUL_LIMIT_BYTES even on one row

    @property
    def outside_bytes(self) -> int | None:
        """What this plan's kernels keep outside torch's allocator (None where the meter cannot read it, or no
        CPU convolution or matrix product ran)."""
        return sum(self._outside.values()) if self._outside else None

    def said(self) -> tuple[str, ...]:
        """The calibration, for the plan's ``not_seen`` (nothing when no convolution or matrix product ran on CPU)."""
        out: tuple[str, ...] = ()
        if self._known:
            scaled = f"; {self.scaled} of them on a batch cut to fit, scaled by the batch" if self.scaled else ""
            out += (f"CPU convolutions' own allocations, not traced but calibrated: {len(self._known)} distinct "
                    f"convolutions run once for real at the planned shape, the most {self.most / 2**20:.1f} MiB, "
                    f"held for each one's duration (workspaces){scaled}",)
        if self._outside:
            large = f"; {self.too_large} matrix products too large to run, not measured" if self.too_large else ""
            out += (f"kept outside torch's allocator by oneDNN's and MKL's kernels (JIT code, primitive caches, "
                    f"buffers): {(self.outside_bytes or 0) / 2**20:.2f} MiB, measured on the first run in this "
                    f"process of {len(self._outside)} distinct convolutions and matrix products{large}; not in the "
                    f"peaks (those are torch's allocator's); a shape that changes every step (MoE routing) adds its "
                    f"own; glibc may also keep freed memory (docs/planning.md)",)
        elif self.too_large:
            out += (f"what {self.too_large} matrix products too large to run keep outside torch's allocator "
                    f"(oneDNN's and MKL's kernels): not measured",)
        return out

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        name = func.name()
        if (name not in _OPS and name not in _MATMULS) or not all(
                t.device.type == "cpu" for t in tree_iter(args) if isinstance(t, torch.Tensor)):
            return 0
        key = _key(func, args)
        if name in _MATMULS:
            self._matmul(key, func, args, kwargs)
            return 0
        if key not in self._known:
            self._known[key] = self._calibrate(key, func, args, kwargs)
            self.most = max(self.most, self._known[key])
        return self._known[key]

    def _matmul(self, key: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if key in self._outside or not _outside.available():
            return
        if key in _KEPT:  # measured by an earlier plan in this process: the kernel's first run is over
            self._outside[key] = _KEPT[key]
            return
        cut = _MATMULS[func.name()]
        first = 1 if func.name() in ("aten::addmm", "aten::baddbmm") else 0  # after the added term
        a, b = args[first], args[first + 1]  # the two multiplied: (m, k) @ (k, n), or batches of them
        rows = a.shape[0]
        per_row = sum(t.numel() * t.element_size() // max(1, rows) for i, t in enumerate(args)
                      if i in cut and isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows)
        fixed = sum(t.numel() * t.element_size() for i, t in enumerate(args)
                    if isinstance(t, torch.Tensor) and not (i in cut and t.dim() and t.shape[0] == rows))
        out_row = (a.shape[1] if a.dim() == 3 else 1) * b.shape[-1] * a.element_size()  # a row (batch) of the output
        if fixed + per_row + out_row > MATMUL_LIMIT_BYTES:
            self.too_large += 1
            return
        keep = max(1, min(rows, (MATMUL_LIMIT_BYTES - fixed) // max(1, per_row + out_row)))

        def run() -> None:
            with unset_fake_temporarily(), torch.no_grad():
                real = tuple(_real(t, keep if i in cut and t.dim() and t.shape[0] == rows else None)
                             if isinstance(t, torch.Tensor) else t for i, t in enumerate(args))
                func(*real, **kwargs)
        _KEPT[key] = self._outside[key] = _kept_outside(run)

    def _calibrate(self, key: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
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

        def real() -> tuple[Any, ...]:
            return tuple(_real(a, batch if i in batched else None) if isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
        with unset_fake_temporarily(), torch.no_grad():
            if _outside.available():  # the first run, plain: what the kernel keeps (its cache, its JIT code)
                if key not in _KEPT:
                    _KEPT[key] = _kept_outside(lambda: func(*real(), **kwargs))
                self._outside[key] = _KEPT[key]
            measured = _peak_inside(func, real(), kwargs)
        return measured if batch is None else measured * full // batch

"""Pieces the CUDA tests share: a spin kernel that holds the GPU behind the CPU, and where results are written."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CUDA_STEPS = 40  # steps per parity test: enough for a stale or overwritten gradient to show in AdamW's state
STRESS_STEPS = 60  # steps per stress test
# torch.cuda._sleep cycles queued before each layer's backward (about 0.5 ms on an H200): the GPU falls behind the
# CPU, so a block freed while its step is still queued is handed out again before the step runs
LAG_CYCLES = 1_000_000


def lag_backward(model: torch.nn.Module, cycles: int = LAG_CYCLES) -> None:
    """Queue a spin kernel on the current stream before each leaf module's backward (the stream the backward runs
    on). Both sides of a comparison get it: it changes timing, never values."""

    def on_output(module, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: torch.cuda._sleep(cycles))

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(on_output)


def results_dir(default: Path) -> Path:
    """``$DIST_OPTIM_GPU_RESULTS`` (tests/gpu/run.sh sets it), else ``default``."""
    out = Path(os.environ.get("DIST_OPTIM_GPU_RESULTS") or default)
    out.mkdir(parents=True, exist_ok=True)
    return out

"""One process on CUDA: in-backward fused AdamW against the standard loop, bitwise over many steps, and the peak
memory it saves (``torch.cuda.max_memory_allocated``), written to ``$DIST_OPTIM_GPU_RESULTS/cuda_memory.json``.

Skipped without a CUDA device (CPU CI): test_parity.py runs the same comparisons on CPU. On CUDA the caching
allocator hands a freed block to the next allocation of its stream while earlier kernels may still be queued, so
the stress test runs many small equal layers (freed gradient blocks fit the next request exactly) with the GPU
held behind the CPU, where a gradient freed too early would be overwritten before its step reads it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch
from cuda_helpers import CUDA_STEPS, STRESS_STEPS, lag_backward, results_dir
from helpers import ADAMW, batches, loss_of, make_model

import dist_optim

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (none in this torch build or machine); test_parity.py covers the same on CPU; "
           "run tests/gpu/run.sh on a GPU machine",
)

def train_pair(a, b, opt_ref, data, stream: torch.cuda.Stream | None = None) -> None:
    """Interleave the in-backward model ``a`` and the standard loop on ``b`` batch by batch, so that each side's
    freed blocks are what the other side allocates next."""
    if stream is not None:  # the model and the data were made on the default stream
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for batch in data:
            loss_of(a, batch).backward()
            loss_of(b, batch).backward()
            opt_ref.step()
            opt_ref.zero_grad()
    torch.cuda.synchronize()


def cuda_data(n: int, width: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.cuda(), y.cuda()) for x, y in batches(n, width=width, seed=seed)]


def assert_bitwise(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs after training: max |diff| {(p - q).abs().max().item()}"


@pytest.mark.parametrize("stream", ["default", "side"])
def test_fused_adamw_in_backward_equals_standard_loop(stream):
    """Same fused kernel both sides: bitwise after CUDA_STEPS steps, on the default stream and with the whole loop on a
    side stream (autograd then runs the backward, and the hooks, on that stream)."""
    a = make_model(width=256, depth=8).cuda()
    b = copy.deepcopy(a)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW, bucket_cap_mb=0.5)
    ref = torch.optim.AdamW(b.parameters(), **ADAMW)
    train_pair(a, b, ref, cuda_data(CUDA_STEPS, 256), torch.cuda.Stream() if stream == "side" else None)
    assert opt.last_step.params_stepped == len(list(a.parameters()))
    assert all(p.grad is None for p in a.parameters())
    assert_bitwise(a, b)


@pytest.mark.parametrize("bucket_cap_mb", [0.001, 4.0], ids=["bucket-per-tensor", "default-buckets"])
def test_stress_many_small_layers_with_the_gpu_lagging(bucket_cap_mb):
    """64 equal 32x32 layers, STRESS_STEPS steps, the GPU held behind the CPU (LAG_CYCLES per layer): the caching
    allocator reuses each freed gradient block at once. A gradient freed before its step ran shows as a difference
    from the standard loop."""
    if os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        pytest.skip("CUDA_LAUNCH_BLOCKING is set: kernels run one at a time, so no stream race can show")
    a = make_model(width=32, depth=64).cuda()
    b = copy.deepcopy(a)
    lag_backward(a)
    lag_backward(b)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW, bucket_cap_mb=bucket_cap_mb)
    ref = torch.optim.AdamW(b.parameters(), **ADAMW)
    train_pair(a, b, ref, cuda_data(STRESS_STEPS, 32), torch.cuda.Stream())
    assert opt.last_step.params_stepped == len(list(a.parameters()))
    assert_bitwise(a, b)


def iteration_peak(step) -> int:
    """Bytes above what was allocated before one training iteration, at its highest."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_memory_saving(tmp_path):
    """8 layers of 2048x2048 (16 MiB of gradient each): the standard loop holds every gradient at its step, the
    in-backward loop one bucket at a time. The saving must reach half of the theoretical one (gradient bytes
    minus the largest bucket); the figures are printed and written as JSON."""
    width, depth = 2048, 8
    model = make_model(width=width, depth=depth).cuda()
    twin = copy.deepcopy(model)
    data = cuda_data(3, width)
    ref = torch.optim.AdamW(twin.parameters(), **ADAMW)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)

    def standard(batch):
        loss_of(twin, batch).backward()
        ref.step()
        ref.zero_grad()

    def in_backward(batch):
        loss_of(model, batch).backward()

    for batch in data[:2]:  # optimizer state exists before the measured iteration, on both sides
        standard(batch)
        in_backward(batch)
    peak_std = iteration_peak(lambda: standard(data[2]))
    peak_inb = iteration_peak(lambda: in_backward(data[2]))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_bucket = max(sum(p.numel() * p.element_size() for p in b) for b in opt.buckets)
    saved = peak_std - peak_inb
    figures = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": f"MLP {depth} x {width}",
        "grad_bytes": grad_bytes, "largest_bucket_bytes": largest_bucket, "peak_bytes_standard": peak_std,
        "peak_bytes_in_backward": peak_inb, "saved_bytes": saved, "saved_fraction_of_grad_bytes": saved / grad_bytes,
        "saved_fraction_of_theoretical": saved / (grad_bytes - largest_bucket),
    }
    path = results_dir(tmp_path) / "cuda_memory.json"
    path.write_text(json.dumps(figures, indent=1))
    print(f"\nCUDA peak of one iteration: standard {peak_std / 2**20:.1f} MiB, in backward {peak_inb / 2**20:.1f} MiB;"
          f" saved {figures['saved_fraction_of_grad_bytes']:.3f} of gradient bytes "
          f"({figures['saved_fraction_of_theoretical']:.3f} of the theoretical saving); written to {path}")
    torch.cuda.synchronize()
    assert_bitwise(model, twin)
    assert saved >= 0.5 * (grad_bytes - largest_bucket), figures

"""Core single-process CPU benchmark: in-backward AdamW against the standard loop and torch's private version.

Run (full, about 1-2 minutes on 2 cores):
    python benchmarks/bench_core.py
Smoke run (a few seconds, tiny models):
    python benchmarks/bench_core.py --quick --out /tmp/bench_core.json

Two models, each trained with a cheap forward (small batch) so the optimizer step is a visible part of an iteration:
  many_small  a stack of Linear+LayerNorm blocks, ~100 parameter tensors, ~40 MiB of fp32 parameters
  few_large   4 Linear layers of 2048x2048, 8 tensors, 64 MiB of fp32 parameters

Variants, each on its own deep copy of the same initial model (hooks stay attached to a model for good):
  standard_fused         loss.backward(); AdamW(fused=True).step(); zero_grad(set_to_none=True)
  standard_default       the same with AdamW's default implementation (reference only)
  inbackward             dist_optim.InBackwardOptimizer(model, AdamW, ...) with default options (auto-fused buckets)
  inbackward_per_param   the same with per_parameter=True
  torch_private_fused    torch.distributed.optim._apply_optimizer_in_backward(AdamW, ..., {"fused": True, ...})
  torch_private_default  the same with AdamW's default implementation
The in-backward variants run the loop their users write: ``loss.backward()`` and nothing else.

1. Step time: one whole training iteration (forward + backward + step). After warm-up, repetitions are interleaved
   (every repetition times a block of iterations of every variant, in a rotated order) and the median per-iteration
   time over repetitions is reported, with the quartiles. Python's cyclic GC is paused while a block is timed.
2. Peak memory: after the warm-up (optimizer state exists, gradients are None), one iteration of each variant runs
   under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; the ``[memory]`` events of
   ``prof.profiler.kineto_results.events()`` (signed byte deltas, + alloc / - free) are sorted by time and the
   maximum of their running sum is that iteration's allocator peak above its starting point. The theoretical saving
   of in-backward is (all gradient bytes) - (largest bucket's gradient bytes), the buckets read from
   ``opt._engine.buckets``; the achieved saving is peak(standard_fused) - peak(inbackward).

Output: a table on stdout and a JSON file (default benchmarks/results/bench_core.json, --out to change it).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import dist_optim

LR = 1e-3
WEIGHT_DECAY = 0.01
MiB = 2**20

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_core.json")

# Targets the project set (ratio = in-backward time / other time; saving fraction = achieved / theoretical).
TARGET_VS_FUSED_MAX = 1.0  # never slower than the fused standard loop
TARGET_VS_FUSED_AIM = 0.85
TARGET_VS_PRIVATE_MAX = 0.8
TARGET_SAVING_MIN = 0.9

VARIANTS = (
    "standard_fused",
    "standard_default",
    "inbackward",
    "inbackward_per_param",
    "torch_private_fused",
    "torch_private_default",
)


# -- models ---------------------------------------------------------------------------------------------------------
def many_small(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def few_large(width: int, n_layers: int) -> nn.Module:
    layers: list[nn.Module] = []
    for k in range(n_layers):
        layers.append(nn.Linear(width, width))
        if k < n_layers - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def model_specs(quick: bool) -> list[dict[str, Any]]:
    if quick:
        return [
            {"name": "many_small", "build": lambda: many_small(64, 8), "in": 64, "desc": "8x(Linear 64+LayerNorm)+Linear"},
            {"name": "few_large", "build": lambda: few_large(256, 3), "in": 256, "desc": "3x Linear 256x256"},
        ]
    return [
        {"name": "many_small", "build": lambda: many_small(640, 24), "in": 640,
         "desc": "24x(Linear 640x640 + LayerNorm 640 + GELU) + Linear 640x640"},
        {"name": "few_large", "build": lambda: few_large(2048, 4), "in": 2048, "desc": "4x Linear 2048x2048 (+GELU)"},
    ]


# -- variants -------------------------------------------------------------------------------------------------------
def make_variant(name: str, model: nn.Module, bucket_cap_mb: float | None) -> tuple[Callable[[torch.Tensor], None], Any]:
    """Attach variant ``name`` to ``model``; return (one training iteration on an input, the optimizer object)."""

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    if name.startswith("standard_"):
        kw = {"fused": True} if name == "standard_fused" else {}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kw)

        def it(x: torch.Tensor) -> None:
            loss_of(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return it, opt

    if name.startswith("inbackward"):
        kw: dict[str, Any] = {"per_parameter": name == "inbackward_per_param"}
        if bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = bucket_cap_mb
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, **kw)

        def it(x: torch.Tensor) -> None:
            loss_of(x).backward()

        return it, opt

    if name.startswith("torch_private_"):
        from torch.distributed.optim import _apply_optimizer_in_backward

        okw: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
        if name == "torch_private_fused":
            okw["fused"] = True
        _apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), okw)

        def it(x: torch.Tensor) -> None:
            loss_of(x).backward()

        return it, None

    raise ValueError(name)


# -- memory ---------------------------------------------------------------------------------------------------------
def profiled_peak(fn: Callable[[], None]) -> dict[str, int]:
    """Allocator peak (bytes above the start) and net change of one call of ``fn``, from the profiler's events."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    deltas.sort(key=lambda t: t[0])  # stable: equal timestamps keep their recorded order
    running = peak = 0
    for _, nbytes in deltas:
        running += nbytes
        peak = max(peak, running)
    return {"peak_bytes": peak, "net_bytes": running, "events": len(deltas)}


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes that the forward keeps alive for backward (the loss and its graph), from the profiler's events."""
    keep: list[torch.Tensor] = []
    res = profiled_peak(lambda: keep.append(model(x).square().mean()))
    keep.clear()
    return res["net_bytes"]


def bucket_bytes(opt: dist_optim.InBackwardOptimizer) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in b.params) for b in opt._engine.buckets]


# -- timing ---------------------------------------------------------------------------------------------------------
def time_block(fn: Callable[[], None], iters: int) -> float:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    finally:
        if gc_was:
            gc.enable()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


# -- one model ------------------------------------------------------------------------------------------------------
def bench_model(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    base = spec["build"]()
    x = torch.randn(args.batch, spec["in"])
    params = list(base.parameters())
    n_params = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)

    runs: dict[str, Callable[[], None]] = {}
    opts: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for name in VARIANTS:
        m = copy.deepcopy(base)
        it, opt = make_variant(name, m, args.bucket_cap_mb)
        runs[name] = (lambda it=it: it(x))
        opts[name] = opt
        models[name] = m

    # Warm-up: creates optimizer state, lets the engine learn its buckets, warms allocator and kernels.
    for name in VARIANTS:
        for _ in range(args.warmup):
            runs[name]()

    # Memory, one profiled iteration each (same count for every variant, so parameters stay comparable).
    memory = {name: profiled_peak(runs[name]) for name in VARIANTS}
    act_bytes = activation_bytes(copy.deepcopy(base), x)

    # Time, interleaved repetitions, rotated order.
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for r in range(args.reps):
        rot = order[r % len(order):] + order[: r % len(order)]
        for name in rot:
            samples[name].append(time_block(runs[name], args.iters))

    timing = {}
    for name in VARIANTS:
        q1, med, q3 = quartiles(samples[name])
        timing[name] = {"median_s": med, "p25_s": q1, "p75_s": q3, "samples_s": samples[name]}

    # Sanity: every variant ran the same iterations on the same data; fused ones must agree with standard_fused.
    ref = list(models["standard_fused"].parameters())
    init = list(base.parameters())
    agreement = {}
    for name in VARIANTS:
        ps = list(models[name].parameters())
        agreement[name] = {
            "max_abs_diff_vs_standard_fused": max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ps, ref)),
            "bitwise_equal_to_standard_fused": all(torch.equal(a, b) for a, b in zip(ps, ref)),
            "moved_from_init": any(not torch.equal(a, b) for a, b in zip(ps, init)),
            "grads_left": sum(p.grad is not None for p in ps),
        }

    inb = opts["inbackward"]
    buckets = bucket_bytes(inb)
    largest_bucket = max(buckets) if buckets else 0
    largest_tensor = max(p.numel() * p.element_size() for p in params)
    theo = grad_bytes - largest_bucket
    theo_pp = grad_bytes - largest_tensor
    std_peak = memory["standard_fused"]["peak_bytes"]

    def saving(name: str, theoretical: int) -> dict[str, Any]:
        achieved = std_peak - memory[name]["peak_bytes"]
        return {
            "theoretical_bytes": theoretical,
            "achieved_bytes": achieved,
            "fraction": (achieved / theoretical) if theoretical > 0 else None,
        }

    med = {n: timing[n]["median_s"] for n in VARIANTS}
    ratios = {
        "inbackward/standard_fused": med["inbackward"] / med["standard_fused"],
        "inbackward/torch_private_fused": med["inbackward"] / med["torch_private_fused"],
        "inbackward/torch_private_default": med["inbackward"] / med["torch_private_default"],
        "inbackward_per_param/standard_fused": med["inbackward_per_param"] / med["standard_fused"],
        "inbackward_per_param/torch_private_fused": med["inbackward_per_param"] / med["torch_private_fused"],
        "inbackward_per_param/torch_private_default": med["inbackward_per_param"] / med["torch_private_default"],
        "torch_private_fused/standard_fused": med["torch_private_fused"] / med["standard_fused"],
    }
    savings = {"inbackward": saving("inbackward", theo), "inbackward_per_param": saving("inbackward_per_param", theo_pp)}
    best_private = min(med["torch_private_fused"], med["torch_private_default"])
    targets = {
        "inbackward_not_slower_than_standard_fused": ratios["inbackward/standard_fused"] <= TARGET_VS_FUSED_MAX,
        "inbackward_at_aim_0.85_of_standard_fused": ratios["inbackward/standard_fused"] <= TARGET_VS_FUSED_AIM,
        "inbackward_at_most_0.8_of_torch_private": med["inbackward"] / best_private <= TARGET_VS_PRIVATE_MAX,
        "inbackward_saving_at_least_0.9_of_theoretical": (
            savings["inbackward"]["fraction"] is not None and savings["inbackward"]["fraction"] >= TARGET_SAVING_MIN
        ),
    }
    return {
        "description": spec["desc"],
        "n_tensors": len(params),
        "n_params": n_params,
        "param_bytes": grad_bytes,
        "grad_bytes": grad_bytes,
        "largest_tensor_bytes": largest_tensor,
        "activation_bytes": act_bytes,
        "inbackward_peak_above_largest_bucket_bytes": memory["inbackward"]["peak_bytes"] - largest_bucket,
        "batch": args.batch,
        "inbackward_buckets": {"count": len(buckets), "bytes": buckets, "tensors": [len(b.params) for b in inb._engine.buckets]},
        "timing": timing,
        "ratios": ratios,
        "memory": memory,
        "memory_saving": savings,
        "targets": targets,
        "agreement": agreement,
    }


# -- report ---------------------------------------------------------------------------------------------------------
def fmt_mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MiB:8.2f}"


def print_model(name: str, res: dict[str, Any]) -> None:
    print(f"\n=== {name}: {res['description']}")
    print(
        f"    {res['n_tensors']} tensors, {res['n_params'] / 1e6:.2f} M params, {res['grad_bytes'] / MiB:.2f} MiB of "
        f"gradients, batch {res['batch']}; in-backward buckets: {res['inbackward_buckets']['count']} "
        f"(MiB: {', '.join(f'{b / MiB:.2f}' for b in res['inbackward_buckets']['bytes'])}); activations kept by "
        f"the forward {res['activation_bytes'] / MiB:.2f} MiB"
    )
    std = res["timing"]["standard_fused"]["median_s"]
    print(f"    {'variant':<24}{'median ms':>10}{'p25':>9}{'p75':>9}{'/std_fused':>11}{'peak MiB':>10}{'net MiB':>9}"
          f"{'max|dp|':>10}")
    for v in VARIANTS:
        t, m, a = res["timing"][v], res["memory"][v], res["agreement"][v]
        print(
            f"    {v:<24}{t['median_s'] * 1e3:10.2f}{t['p25_s'] * 1e3:9.2f}{t['p75_s'] * 1e3:9.2f}"
            f"{t['median_s'] / std:11.3f}{fmt_mib(m['peak_bytes']):>10}{m['net_bytes'] / MiB:9.2f}"
            f"{a['max_abs_diff_vs_standard_fused']:10.1e}"
        )
    print("    ratios:")
    for k, r in res["ratios"].items():
        print(f"      {k:<44}{r:7.3f}")
    print("    memory saving vs standard_fused (achieved / theoretical):")
    for v, s in res["memory_saving"].items():
        frac = "n/a" if s["fraction"] is None else f"{s['fraction']:.3f}"
        print(f"      {v:<24} {fmt_mib(s['achieved_bytes'])} / {fmt_mib(s['theoretical_bytes'])} MiB = {frac}")
    print(f"    in-backward peak above its largest bucket: {res['inbackward_peak_above_largest_bucket_bytes'] / MiB:.2f} MiB"
          " (activations still alive when that bucket completes, plus the backward's temporaries)")
    print("    targets:")
    for k, ok in res["targets"].items():
        print(f"      {k:<50}{'met' if ok else 'MISSED'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, few repetitions (a smoke run of seconds)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT})")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: min(2, CPUs))")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 15; quick 3)")
    p.add_argument("--iters", type=int, default=None, help="iterations per timed block (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations per variant (default 3; quick 2)")
    p.add_argument("--batch", type=int, default=None, help="input rows per iteration (default 32; quick 8)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="InBackwardOptimizer bucket_cap_mb (default: the engine's default; quick: 0.05 so that the "
                        "tiny models still have several buckets)")
    p.add_argument("--models", default="many_small,few_large", help="comma-separated subset of the models")
    a = p.parse_args(argv)
    a.threads = a.threads or min(2, os.cpu_count() or 1)
    a.reps = a.reps or (3 if a.quick else 15)
    a.iters = a.iters or (1 if a.quick else 3)
    a.warmup = a.warmup or (2 if a.quick else 3)
    a.batch = a.batch or (8 if a.quick else 32)
    if a.bucket_cap_mb is None and a.quick:
        a.bucket_cap_mb = 0.05
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = set(args.models.split(","))
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "bench_core",
        "mode": "quick" if args.quick else "full",
        "config": {
            "threads": torch.get_num_threads(), "reps": args.reps, "iters_per_block": args.iters,
            "warmup": args.warmup, "batch": args.batch, "lr": LR, "weight_decay": WEIGHT_DECAY,
            "bucket_cap_mb": args.bucket_cap_mb if args.bucket_cap_mb is not None else "engine default",
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "targets": {
            "inbackward/standard_fused max": TARGET_VS_FUSED_MAX, "inbackward/standard_fused aim": TARGET_VS_FUSED_AIM,
            "inbackward/torch_private max": TARGET_VS_PRIVATE_MAX, "saving fraction min": TARGET_SAVING_MIN,
        },
        "models": {},
    }
    load0 = os.getloadavg()
    if load0[0] > 1.0:
        print(f"WARNING: 1-minute load average is {load0[0]:.2f} before the run: other processes compete for the CPUs "
              "and the timings will be noisy", file=sys.stderr)
    print(f"bench_core ({results['mode']}): torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.reps} interleaved reps x {args.iters} iterations, medians")
    for spec in model_specs(args.quick):
        if spec["name"] not in wanted:
            continue
        res = bench_model(spec, args)
        results["models"][spec["name"]] = res
        print_model(spec["name"], res)
    results["wall_s"] = time.perf_counter() - t0
    results["env"]["loadavg_before"] = list(load0)
    results["env"]["loadavg_after"] = list(os.getloadavg())
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwall {results['wall_s']:.1f} s; results written to {args.out}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""Core single-process CPU benchmark: in-backward AdamW against the standard loop and torch's private version.

Run (full, about a minute on 2 cores):
    python benchmarks/bench_core.py
Smoke run (a few seconds, tiny models):
    python benchmarks/bench_core.py --quick --out /tmp/bench_core.json

Two models, each trained with a cheap forward (batch 8) so that the optimizer step is a visible part of an iteration:
  many_small  24 x (Linear 640x640 + LayerNorm + GELU) + Linear: 98 parameter tensors, 39 MiB of fp32 parameters
  few_large   4 x Linear 2048x2048: 8 tensors, 64 MiB of fp32 parameters

Variants, each on its own deep copy of the same initial model (hooks stay attached to a model for good):
  standard_fused         loss.backward(); AdamW(fused=True).step(); zero_grad(set_to_none=True)
  standard_default       the same with AdamW's default implementation (reference only)
  inbackward             dist_optim.InBackwardOptimizer(model, AdamW, ...) with default options (auto-fused buckets)
  inbackward_per_param   the same with per_parameter=True
  torch_private_fused    torch.distributed.optim._apply_optimizer_in_backward(AdamW, ..., {"fused": True, ...})
  torch_private_default  the same with AdamW's default implementation
The in-backward variants run the loop their users write: ``loss.backward()`` and nothing else. Every variant runs
the same iterations on the same input, so at the end the fused ones must equal standard_fused bitwise (checked).

1. Step time: one whole training iteration (forward + backward + step). After warm-up, repetitions are interleaved
   (every repetition times a block of iterations of every variant, in a rotated order) and the median per-iteration
   time over repetitions is reported, with the quartiles. Python's cyclic GC is paused while a block is timed.
   Ratios are given two ways: of the medians, and the median of the per-repetition ratios (both variants timed
   within half a second of each other, which cancels the machine's slow drift); the targets use the latter.
   The C allocator (--malloc):
     pinned (default)  before anything is built, mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=1 GiB) (glibc):
                       freed blocks stay in the process's heap and are reused, as a caching allocator does on a GPU,
                       so no variant faults fresh pages in and the figures compare the work itself.
     glibc             the allocator as users have it: glibc hands large freed blocks back to the OS (munmap, heap
                       trim) and the next iteration faults zeroed pages in again, 4 KiB at a time. Whether that
                       happens to a variant depends on the heap's history, which the interleaved variants share, so
                       these figures swing by tens of percent from run to run (the standard loop, which frees every
                       gradient at once, is the one usually hit). Minor page faults per iteration are reported in
                       both modes.
2. Peak memory: after the warm-up (optimizer state exists, gradients are None), one iteration of each variant runs
   under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; the ``[memory]`` events of
   ``prof.profiler.kineto_results.events()`` (signed byte deltas, + alloc / - free) are sorted by time and the
   maximum of their running sum is that iteration's allocator peak above its starting point. The theoretical saving
   of in-backward is (all gradient bytes) - (largest bucket's gradient bytes), the buckets read from
   ``opt._engine.buckets``; the achieved saving is peak(standard_fused) - peak(inbackward). The same is measured at
   4x the batch, to show the activations that are still alive when the largest bucket completes eating into it.

Output: a table on stdout and a JSON file (default benchmarks/results/bench_core.json, --out to change it).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import resource
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

# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


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
            {"name": "many_small", "build": lambda: many_small(64, 8), "in": 64,
             "desc": "8x(Linear 64x64 + LayerNorm 64 + GELU) + Linear 64x64"},
            {"name": "few_large", "build": lambda: few_large(256, 3), "in": 256, "desc": "3x Linear 256x256 (+GELU)"},
        ]
    return [
        {"name": "many_small", "build": lambda: many_small(640, 24), "in": 640,
         "desc": "24x(Linear 640x640 + LayerNorm 640 + GELU) + Linear 640x640"},
        {"name": "few_large", "build": lambda: few_large(2048, 4), "in": 2048, "desc": "4x Linear 2048x2048 (+GELU)"},
    ]


# -- variants -------------------------------------------------------------------------------------------------------
def make_variant(
    name: str, model: nn.Module, bucket_cap_mb: float | None
) -> tuple[Callable[[torch.Tensor], None], Any]:
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
    return [sum(p.numel() * p.element_size() for p in b) for b in opt.buckets]


def saving_at_batch(spec: dict[str, Any], base: nn.Module, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Memory only (deterministic, about a second): standard_fused vs inbackward at another batch size."""
    x = torch.randn(batch, spec["in"])
    peaks, theo = {}, 0
    for name in ("standard_fused", "inbackward"):
        m = copy.deepcopy(base)
        it, opt = make_variant(name, m, args.bucket_cap_mb)
        for _ in range(2):
            it(x)
        peaks[name] = profiled_peak(lambda: it(x))["peak_bytes"]
        if name == "inbackward":
            theo = sum(p.numel() * p.element_size() for p in m.parameters()) - max(bucket_bytes(opt))
            opt.remove()
    achieved = peaks["standard_fused"] - peaks["inbackward"]
    return {
        "batch": batch, "activation_bytes": activation_bytes(copy.deepcopy(base), x),
        "standard_fused_peak_bytes": peaks["standard_fused"], "inbackward_peak_bytes": peaks["inbackward"],
        "theoretical_bytes": theo, "achieved_bytes": achieved, "fraction": achieved / theo if theo > 0 else None,
    }


# -- timing ---------------------------------------------------------------------------------------------------------
def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_block(fn: Callable[[], None], iters: int) -> tuple[float, float]:
    """Seconds per iteration and minor page faults per iteration over ``iters`` calls of ``fn``."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        f0 = minor_faults()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        return (t1 - t0) / iters, (minor_faults() - f0) / iters
    finally:
        if gc_was:
            gc.enable()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def time_interleaved(
    runs: dict[str, Callable[[], None]], args: argparse.Namespace, variants: tuple[str, ...] = VARIANTS
) -> dict[str, Any]:
    """Interleaved, rotated repetitions of every variant; per-iteration medians and quartiles."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.reps):
        k = r % len(variants)
        for name in variants[k:] + variants[:k]:
            dt, nf = time_block(runs[name], args.iters)
            samples[name].append(dt)
            faults[name].append(nf)
    out = {}
    for name in variants:
        q1, med, q3 = quartiles(samples[name])
        out[name] = {
            "median_s": med, "p25_s": q1, "p75_s": q3, "samples_s": samples[name],
            "minor_faults_per_iter_median": statistics.median(faults[name]),
        }
    return out


def pin_malloc() -> dict[str, Any] | None:
    """Keep freed blocks in glibc's heap (no munmap, no trim) from now on; None where this is not glibc."""
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * MiB) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1024 * MiB) == 1
    except (OSError, AttributeError):
        return None
    return {"M_MMAP_THRESHOLD": 32 * MiB, "M_TRIM_THRESHOLD": 1024 * MiB} if ok else None


RATIOS = (
    ("inbackward", "standard_fused"),
    ("inbackward", "torch_private_fused"),
    ("inbackward", "torch_private_default"),
    ("inbackward_per_param", "standard_fused"),
    ("inbackward_per_param", "torch_private_fused"),
    ("inbackward_per_param", "torch_private_default"),
    ("torch_private_fused", "standard_fused"),
)


def ratio(timing: dict[str, Any], a: str, b: str) -> dict[str, float]:
    """a's time over b's: the ratio of the medians, and the median (and quartiles) of the per-repetition ratios. A
    repetition times a and b within half a second of each other, so the paired ratio cancels the machine's drift and
    is the one the targets are judged on."""
    paired = [x / y for x, y in zip(timing[a]["samples_s"], timing[b]["samples_s"])]
    q1, med, q3 = quartiles(paired)
    return {"of_medians": timing[a]["median_s"] / timing[b]["median_s"], "paired_median": med, "paired_p25": q1,
            "paired_p75": q3}


# -- one model ------------------------------------------------------------------------------------------------------
class ModelBench:
    """The six variants of one model: built, warmed up, their memory measured; then timed."""

    def __init__(self, spec: dict[str, Any], args: argparse.Namespace) -> None:
        self.spec, self.args = spec, args
        torch.manual_seed(0)
        self.base = spec["build"]()
        self.x = torch.randn(args.batch, spec["in"])
        self.runs: dict[str, Callable[[], None]] = {}
        self.opts: dict[str, Any] = {}
        self.models: dict[str, nn.Module] = {}
        for name in VARIANTS:
            m = copy.deepcopy(self.base)
            it, opt = make_variant(name, m, args.bucket_cap_mb)
            self.runs[name] = (lambda it=it: it(self.x))
            self.opts[name] = opt
            self.models[name] = m
        # Warm-up: creates optimizer state, lets the engine learn its buckets, warms allocator and kernels.
        self.warm(args.warmup)
        # Memory, one profiled iteration each (same count for every variant, so their parameters stay comparable).
        self.memory = {name: profiled_peak(self.runs[name]) for name in VARIANTS}
        self.activation_bytes = activation_bytes(copy.deepcopy(self.base), self.x)
        self.sensitivity = saving_at_batch(spec, self.base, 4 * args.batch, args)
        self.timing: dict[str, Any] = {}

    def warm(self, iters: int) -> None:
        for name in VARIANTS:
            for _ in range(iters):
                self.runs[name]()

    def time(self) -> None:
        self.timing = time_interleaved(self.runs, self.args)

    def result(self) -> dict[str, Any]:
        params = list(self.base.parameters())
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        # Sanity: every variant ran the same iterations on the same data; fused ones must equal standard_fused.
        ref = list(self.models["standard_fused"].parameters())
        agreement = {}
        for name in VARIANTS:
            ps = list(self.models[name].parameters())
            agreement[name] = {
                "max_abs_diff_vs_standard_fused": max(
                    float((a.detach() - b.detach()).abs().max()) for a, b in zip(ps, ref)
                ),
                "bitwise_equal_to_standard_fused": all(torch.equal(a, b) for a, b in zip(ps, ref)),
                "moved_from_init": any(not torch.equal(a, b) for a, b in zip(ps, params)),
                "grads_left": sum(p.grad is not None for p in ps),
            }

        inb = self.opts["inbackward"]
        buckets = bucket_bytes(inb)
        largest_bucket = max(buckets)
        largest_tensor = max(p.numel() * p.element_size() for p in params)
        std_peak = self.memory["standard_fused"]["peak_bytes"]

        def saving(name: str, theoretical: int) -> dict[str, Any]:
            achieved = std_peak - self.memory[name]["peak_bytes"]
            return {"theoretical_bytes": theoretical, "achieved_bytes": achieved,
                    "fraction": (achieved / theoretical) if theoretical > 0 else None}

        savings = {
            "inbackward": saving("inbackward", grad_bytes - largest_bucket),
            "inbackward_per_param": saving("inbackward_per_param", grad_bytes - largest_tensor),
        }
        frac = savings["inbackward"]["fraction"]
        ratios = {f"{a}/{b}": ratio(self.timing, a, b) for a, b in RATIOS}

        def r(key: str) -> float:
            return ratios[key]["paired_median"]

        targets = {
            "inbackward_not_slower_than_standard_fused": r("inbackward/standard_fused") <= TARGET_VS_FUSED_MAX,
            "inbackward_at_aim_0.85_of_standard_fused": r("inbackward/standard_fused") <= TARGET_VS_FUSED_AIM,
            "inbackward_at_most_0.8_of_torch_private_default": (
                r("inbackward/torch_private_default") <= TARGET_VS_PRIVATE_MAX
            ),
            "inbackward_at_most_0.8_of_torch_private_fused": (
                r("inbackward/torch_private_fused") <= TARGET_VS_PRIVATE_MAX
            ),
            "inbackward_saving_at_least_0.9_of_theoretical": frac is not None and frac >= TARGET_SAVING_MIN,
        }
        return {
            "description": self.spec["desc"],
            "batch": self.args.batch,
            "n_tensors": len(params),
            "n_params": sum(p.numel() for p in params),
            "grad_bytes": grad_bytes,
            "largest_tensor_bytes": largest_tensor,
            "activation_bytes": self.activation_bytes,
            "inbackward_buckets": {
                "count": len(buckets), "bytes": buckets, "tensors": [len(b) for b in inb.buckets],
            },
            "memory": self.memory,
            "memory_saving": savings,
            "inbackward_peak_above_largest_bucket_bytes": self.memory["inbackward"]["peak_bytes"] - largest_bucket,
            "memory_saving_at_4x_batch": self.sensitivity,
            "timing": self.timing,
            "ratios": ratios,
            "targets": targets,
            "agreement": agreement,
        }


# -- other processes ------------------------------------------------------------------------------------------------
def _cpu_busy_s() -> float | None:
    """CPU seconds all processes of the machine have been busy (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Contention:
    """CPU time that other processes used while we ran, as a fraction of the machine's capacity over that wall time:
    timings are comparable only when it stays near zero."""

    def __init__(self) -> None:
        self.busy0, self.own0, self.wall0 = _cpu_busy_s(), _own_cpu_s(), time.perf_counter()

    def others_fraction(self) -> float | None:
        busy = _cpu_busy_s()
        if busy is None or self.busy0 is None:
            return None
        others = (busy - self.busy0) - (_own_cpu_s() - self.own0)
        return max(0.0, others) / ((time.perf_counter() - self.wall0) * (os.cpu_count() or 1))


def idle_check(seconds: float = 0.5) -> float | None:
    c = Contention()
    time.sleep(seconds)
    return c.others_fraction()


# -- report ---------------------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / MiB:.2f}"


def _frac(f: float | None) -> str:
    return "n/a" if f is None else f"{f:.3f}"


def print_model(name: str, res: dict[str, Any]) -> None:
    print(f"\n=== {name}: {res['description']}")
    b = res["inbackward_buckets"]
    print(f"    {res['n_tensors']} tensors, {res['n_params'] / 1e6:.2f} M params, {_mib(res['grad_bytes'])} MiB of "
          f"gradients, batch {res['batch']}, activations kept by the forward {_mib(res['activation_bytes'])} MiB")
    print(f"    in-backward buckets: {b['count']} of {', '.join(_mib(x) for x in b['bytes'])} MiB "
          f"({', '.join(str(n) for n in b['tensors'])} tensors)")
    t = res["timing"]
    std = t["standard_fused"]["median_s"]
    print(f"    {'variant':<24}{'median ms':>10}{'p25':>8}{'p75':>8}{'/std_fused':>11}{'faults/it':>10}{'peak MiB':>10}"
          f"{'max|dp|':>9}")
    for v in VARIANTS:
        print(f"    {v:<24}{t[v]['median_s'] * 1e3:10.2f}{t[v]['p25_s'] * 1e3:8.2f}{t[v]['p75_s'] * 1e3:8.2f}"
              f"{t[v]['median_s'] / std:11.3f}{t[v]['minor_faults_per_iter_median']:10.0f}"
              f"{_mib(res['memory'][v]['peak_bytes']):>10}{res['agreement'][v]['max_abs_diff_vs_standard_fused']:9.1e}")
    print(f"    ratios{'':<40}{'of medians':>11}{'paired median (p25-p75)':>27}")
    for key, r in res["ratios"].items():
        paired = f"{r['paired_median']:.3f} ({r['paired_p25']:.3f}-{r['paired_p75']:.3f})"
        print(f"      {key:<42}{r['of_medians']:11.3f}{paired:>27}")
    print("    memory saving vs standard_fused (achieved / theoretical):")
    for v, s in res["memory_saving"].items():
        print(f"      {v:<24}{_mib(s['achieved_bytes']):>8} / {_mib(s['theoretical_bytes'])} MiB = "
              f"{_frac(s['fraction'])}")
    print(f"      in-backward peak is {_mib(res['inbackward_peak_above_largest_bucket_bytes'])} MiB above its largest "
          "bucket (activations still alive when that bucket completes, backward temporaries)")
    s4 = res["memory_saving_at_4x_batch"]
    print(f"      at batch {s4['batch']} (activations {_mib(s4['activation_bytes'])} MiB): peaks "
          f"{_mib(s4['standard_fused_peak_bytes'])} vs {_mib(s4['inbackward_peak_bytes'])} MiB, saving "
          f"{_mib(s4['achieved_bytes'])} / {_mib(s4['theoretical_bytes'])} MiB = {_frac(s4['fraction'])}")
    print("    targets (paired medians):")
    for key, ok in res["targets"].items():
        print(f"      {key:<51}{'met' if ok else 'MISSED'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, few repetitions (a smoke run of seconds)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT})")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: min(2, CPUs))")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 35; quick 3)")
    p.add_argument("--iters", type=int, default=None, help="iterations per timed block (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations per variant (default 3; quick 2)")
    p.add_argument("--batch", type=int, default=8, help="input rows per iteration (default 8)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="InBackwardOptimizer bucket_cap_mb (default: the engine's default; quick: 0.05 so that the "
                        "tiny models still have several buckets)")
    p.add_argument("--malloc", choices=("pinned", "glibc"), default="pinned",
                   help="pinned: keep freed blocks in the heap (mallopt, glibc), no page faults; glibc: as users have "
                        "it (noisy: see the module docstring). Default: pinned")
    p.add_argument("--models", default="many_small,few_large", help="comma-separated subset of the models")
    a = p.parse_args(argv)
    a.threads = a.threads or min(2, os.cpu_count() or 1)
    a.reps = a.reps or (3 if a.quick else 35)
    a.iters = a.iters or (1 if a.quick else 3)
    a.warmup = a.warmup or (2 if a.quick else 3)
    if a.bucket_cap_mb is None and a.quick:
        a.bucket_cap_mb = 0.05
    return a


class Run:
    """What every benchmark does around its measurements: threads, allocator, a check that the machine is idle
    before and during the run, and the wall time."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(args.threads)
        self.busy_before = idle_check()
        if self.busy_before is not None and self.busy_before > 0.1:
            print(f"WARNING: other processes keep {self.busy_before:.0%} of the CPUs busy before the run; the "
                  "timings will be noisy", file=sys.stderr)
        self.pinned = pin_malloc() if args.malloc == "pinned" else None
        if args.malloc == "pinned" and self.pinned is None:
            print("--malloc pinned: not glibc, the allocator is left as it is", file=sys.stderr)
        self.contention = Contention()
        self.t0 = time.perf_counter()

    def finish(self, results: dict[str, Any], out: str) -> None:
        """Record the wall time and the CPU contention in ``results`` and write them to ``out`` as JSON."""
        results["wall_s"] = time.perf_counter() - self.t0
        others = self.contention.others_fraction()
        results["env"]["other_processes_cpu_fraction_before"] = self.busy_before
        results["env"]["other_processes_cpu_fraction_during"] = others
        if others is not None:
            print(f"\nother processes used {others:.1%} of the CPUs during the run"
                  + ("  <-- WARNING: contended, timings unreliable" if others > 0.05 else ""))
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wall {results['wall_s']:.1f} s; results written to {out}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wanted = [s for s in model_specs(args.quick) if s["name"] in args.models.split(",")]
    run = Run(args)
    pinned = run.pinned
    print(f"bench_core ({'quick' if args.quick else 'full'}): torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, malloc {args.malloc if pinned or args.malloc == 'glibc' else 'as is'}, {args.reps} interleaved "
          f"reps x {args.iters} iterations, medians", flush=True)

    benches = {spec["name"]: ModelBench(spec, args) for spec in wanted}
    for bench in benches.values():
        bench.time()

    results: dict[str, Any] = {
        "benchmark": "bench_core",
        "mode": "quick" if args.quick else "full",
        "config": {
            "threads": torch.get_num_threads(), "reps": args.reps, "iters_per_block": args.iters,
            "warmup": args.warmup, "batch": args.batch, "lr": LR, "weight_decay": WEIGHT_DECAY,
            "bucket_cap_mb": args.bucket_cap_mb if args.bucket_cap_mb is not None else "engine default",
            "malloc": args.malloc, "mallopt": pinned,
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "targets": {
            "inbackward/standard_fused max": TARGET_VS_FUSED_MAX, "inbackward/standard_fused aim": TARGET_VS_FUSED_AIM,
            "inbackward/torch_private (each implementation) max": TARGET_VS_PRIVATE_MAX,
            "saving fraction min": TARGET_SAVING_MIN,
        },
        "models": {},
    }
    for name, bench in benches.items():
        res = bench.result()
        results["models"][name] = res
        print_model(name, res)

    run.finish(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""The benchmarks' shared harness: options, models, timing, memory peaks, spawned ranks and the results file.

Every benchmark compares variants of one training unit (an iteration, an optimizer step) with :func:`measure`:
warm-up, the allocator peak of one unit each, interleaved paired timing, bitwise agreement with a reference
variant. Times are medians over interleaved repetitions and ratios are paired (measured in the same run); peaks
come from :func:`allocator_peak` (CPU: torch.profiler's memory events; CUDA: ``max_memory_allocated``).

:func:`spawn` starts fresh ranks for each run and is not the tests' runner (``tests/dist_runner.py``), on purpose:
a rank's peak, gloo's threads included, is measured from a clean process, with the heap shim preloaded
(``LD_PRELOAD``, fixed when the process starts) and glibc's allocator pinned before the process group exists. The
tests' runner keeps its ranks for the whole session (starting them is the slow part), whose heap carries the
scenarios before into any peak; one spawner would cost one side its speed or the other its figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import dist_optim
from launch.memory_peak import allocator_peak, quiet_kineto

__all__ = ["add_rank_memory_options", "adamw", "agreement", "allocator_peak", "bucket_bytes", "device_of",
           "few_large", "fully_shard_blocks", "in_backward", "local", "many_small", "measure", "mib", "models", "nbytes", "parse", "parser", "print_table",
           "quartiles", "ratio", "Run", "spawn", "spawn_ranks", "standard", "time_interleaved", "unit_peak", "Variant"]

LR, WEIGHT_DECAY, MiB = 1e-3, 0.01, 2**20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHIM_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_shim.c")
Fn = Callable[[], None]


# -- options --------------------------------------------------------------------------------------------------------
def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes; ``None`` defaults are filled by :func:`parse` (quick or full)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, few repetitions: a smoke run of seconds")
    p.add_argument("--out", default=os.path.join(RESULTS, f"{name}.json"), help="the JSON results file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where models run (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per process")
    p.add_argument("--repeats", type=int, default=None, help="interleaved timed repetitions")
    p.add_argument("--iters", type=int, default=None, help="units per timed block")
    p.add_argument("--warmup", type=int, default=None, help="untimed units per variant first")
    p.add_argument("--batch", type=int, default=8, help="input rows per unit (per rank) (default 8)")
    p.add_argument("--malloc", choices=("pinned", "glibc"), default="pinned",
                   help="pinned: glibc keeps freed blocks for reuse (mallopt), as a caching allocator does, so no "
                        "variant pays for faulting pages in; glibc: as users have it (noisier). Default pinned")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict[str, Any], full: dict[str, Any]
          ) -> argparse.Namespace:
    """Parse; every option left at ``None`` takes its value from ``quick`` or ``full``."""
    p.epilog = "defaults, full | quick: " + ", ".join(
        f"--{k.replace('_', '-')} {full.get(k)} | {quick.get(k)}" for k in full if k != "world")
    a = p.parse_args(argv)
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch build or machine has no CUDA device")
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


def device_of(args: argparse.Namespace, rank: int = 0) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


# -- models and optimizers -------------------------------------------------------------------------------------------
def many_small(width: int, depth: int) -> nn.Sequential:
    """``depth`` blocks of (Linear, LayerNorm, GELU) and a final Linear: many small tensors, shardable per block."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def few_large(width: int, n: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(n):
        layers += [nn.Linear(width, width)] + ([nn.GELU()] if k < n - 1 else [])
    return nn.Sequential(*layers)


def models(quick: bool) -> dict[str, tuple[Callable[[], nn.Sequential], int]]:
    """The single-process models, each (its builder, its input width): many_small (98 tensors, 39 MiB; quick: 34
    tensors), few_large (4 x 16 MiB; quick: 3 x 0.25 MiB) and big_tensors (2 x 64 MiB, above glibc's largest
    mmap threshold, 32 MiB: where freed gradients go back to the OS and are faulted in again; quick: as few_large)."""
    (w, d), (v, n), (b, k) = ((64, 8), (256, 3), (256, 2)) if quick else ((640, 24), (2048, 4), (4096, 2))
    return {"many_small": (lambda: many_small(w, d), w), "few_large": (lambda: few_large(v, n), v),
            "big_tensors": (lambda: few_large(b, k), b)}


def adamw(params: Any, **kw: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **{"fused": True, **kw})


def in_backward(model: nn.Module, bucket_cap_mb: float | None = None, **kw: Any) -> dist_optim.InBackwardOptimizer:
    if bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = bucket_cap_mb
    return dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, **kw)


def fully_shard_blocks(module: nn.Sequential, mesh: Any) -> nn.Module:
    """FSDP2: ``fully_shard`` each block of :func:`many_small`, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in list(module)[:-1]:
        fully_shard(block, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def bucket_bytes(opt: dist_optim.InBackwardOptimizer) -> list[int]:
    """Local bytes of each bucket the optimizer steps (and frees) at once: DDP's buckets under DDP."""
    return [nbytes(b) for b in opt.buckets]


def mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MiB:.2f}"


# -- memory ---------------------------------------------------------------------------------------------------------
def unit_peak(steps: Sequence[Fn], device: torch.device) -> dict[str, Any]:
    """Peak of a unit of several steps (micro-batches) above the unit's start: each step measured on its own and
    placed above what the steps before it left allocated."""
    base, each = 0, []
    for step in steps:
        r = allocator_peak(step, device)
        each.append(base + r["peak_bytes"])
        base += r["net_bytes"]
    return {"peak_bytes": max(each), "net_bytes": base, "source": r["source"], "events": r.get("events", 0),
            **({"per_step_peak_bytes": each} if len(each) > 1 else {})}


class HeapShim:
    """heap_shim.c, preloaded into this process: the tensor bytes of every thread (gloo's work threads too)."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)  # the handle of the preloaded copy
        self.lib.shim_current.restype = self.lib.shim_peak.restype = ctypes.c_long

    @classmethod
    def loaded(cls) -> HeapShim | None:
        path = os.environ.get("DIST_OPTIM_BENCH_HEAP_SHIM")
        return cls(path) if path else None

    @classmethod
    def required(cls) -> HeapShim:
        """The preloaded shim, or a RuntimeError: a rank's peak without it would miss gloo's threads."""
        shim = cls.loaded()
        if shim is None:
            raise RuntimeError("benchmarks/heap_shim.c is not preloaded: the per-rank peak would miss gloo's threads")
        return shim

    def warm_step(self, step: Fn, base: int, times: int) -> dict[str, Any]:
        """A warm ``step``'s figures on this rank: the live bytes at its start above ``base`` (every thread's
        tensors; the most frequent of ``times`` steps' starts: a buffer gloo frees late, on its own thread, can
        still be alive when one step starts), its peak above the start (the median of ``times`` steps, each
        kept), and the profiler's peak of one more (the calling thread only: the difference is what other threads
        allocate as tensors)."""
        gc.collect()
        peak = self.peak(step, times)
        return {"start_bytes": mode(peak["start_each"]) - base, "start_each": [s - base for s in peak["start_each"]],
                "step_peak_bytes": peak["peak_bytes"], "step_peak_each": peak["peak_bytes_each"],
                "profiler_step_peak_bytes": allocator_peak(step)["peak_bytes"]}

    def peak(self, fn: Fn, times: int) -> dict[str, Any]:
        """Median over ``times`` calls of ``fn`` of the peak above the call's start (gloo's timing moves it by a
        block now and then)."""
        each, starts = [], []
        with gc_paused():
            for _ in range(times):
                self.lib.shim_reset()
                start = self.lib.shim_current()
                fn()
                each.append(self.lib.shim_peak() - start)
                starts.append(start)
        return {"source": "heap_shim", "peak_bytes": sorted(each)[(len(each) - 1) // 2], "peak_bytes_each": each,
                "start_each": starts}


def mode(xs: list[int]) -> int:
    """The most frequent value (the lowest of those, on a tie)."""
    counts = collections.Counter(xs)
    most = max(counts.values())
    return min(x for x, n in counts.items() if n == most)


def build_shim(folder: str) -> tuple[str | None, str]:
    """Compile heap_shim.c into ``folder``: (the library, "") or (None, why not)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None, "not Linux with glibc"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC)"
    lib = os.path.join(folder, "libheap_shim.so")
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, SHIM_SRC], capture_output=True, text=True)
    return (lib, "") if proc.returncode == 0 else (None, f"{cc} failed: {proc.stderr.strip()[-500:]}")


def pin_malloc() -> bool:
    """Keep freed blocks in glibc's heap from now on (no munmap, no trim); False where this is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.mallopt(-3, 32 * MiB) == 1 and libc.mallopt(-1, 1024 * MiB) == 1  # M_MMAP_, M_TRIM_THRESHOLD


# -- timing ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def quartiles(xs: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median_s": statistics.median(xs), "p25_s": q[0], "p75_s": q[2], "samples_s": xs}


def time_block(fn: Fn, iters: int, device: torch.device) -> tuple[float, float]:
    """Seconds and minor page faults per call over ``iters`` calls (CUDA: between events, synchronized)."""
    with gc_paused():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            seconds = time.perf_counter() - t0
        return seconds / iters, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / iters


def time_interleaved(runs: dict[str, Fn], repeats: int, iters: int, device: torch.device) -> dict[str, Any]:
    """Every repetition times a block of every variant, in an order rotated from one repetition to the next."""
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            dt, nf = time_block(runs[n], iters, device)
            samples[n].append(dt)
            faults[n].append(nf)
    return {n: {**quartiles(samples[n]), "minor_faults_per_iter": statistics.median(faults[n])} for n in names}


def ratio(timing: dict[str, Any], a: str, b: str) -> dict[str, float]:
    """a's time over b's: of the medians, and the median and quartiles of the per-repetition ratios (paired: both
    timed moments apart, which cancels the machine's drift; the figure the docs quote)."""
    paired = quartiles([x / y for x, y in zip(timing[a]["samples_s"], timing[b]["samples_s"])])
    return {"of_medians": timing[a]["median_s"] / timing[b]["median_s"], "paired_median": paired["median_s"],
            "paired_p25": paired["p25_s"], "paired_p75": paired["p75_s"]}


# -- comparing variants ---------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One way to train: its unit (steps run in order: micro-batches), its model's parameters and optimizer."""

    steps: list[Fn]
    params: list[torch.Tensor]
    opt: Any = None
    reference: str | None = None  # the variant it must equal bitwise at the end (None: it is a reference)
    initial: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.initial = [local(p.detach()).clone() for p in self.params]

    def unit(self) -> None:
        for step in self.steps:
            step()


def standard(backward: Fn, params: list[torch.Tensor], opt: torch.optim.Optimizer) -> Variant:
    """The standard loop as a variant: ``backward(); opt.step(); opt.zero_grad()``, a reference."""

    def step() -> None:
        backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Variant([step], params, opt)


def agreement(pa: list[torch.Tensor], oa: Any, pb: list[torch.Tensor], ob: Any) -> dict[str, Any]:
    """Parameters ``pa`` against ``pb`` (and the state of optimizers ``oa``, ``ob`` where both exist), this rank's."""
    la, lb = [local(p.detach()) for p in pa], [local(p.detach()) for p in pb]
    out = {"params_bitwise_equal": all(torch.equal(x, y) for x, y in zip(la, lb)),
           "max_abs_diff": max((float((x - y).abs().max()) for x, y in zip(la, lb) if x.numel()), default=0.0)}
    if hasattr(oa, "state") and hasattr(ob, "state"):
        out["state_bitwise_equal"] = all(
            x.keys() == y.keys() and all(torch.equal(local(x[k]), local(y[k])) if isinstance(x[k], torch.Tensor)
                                         else x[k] == y[k] for k in x)
            for x, y in zip((oa.state.get(p, {}) for p in pa), (ob.state.get(p, {}) for p in pb)))
    return out


def measure(variants: dict[str, Variant], args: argparse.Namespace, pairs: Sequence[tuple[str, str]],
            device: torch.device, memory_iters: int = 3) -> dict[str, Any]:
    """Warm every variant up, take the allocator peak of one unit each (and the all-thread tensor peak where the
    heap shim is preloaded), time them interleaved, then check each against its reference. On every rank of a
    multi-process run alike: their collectives match."""
    for v in variants.values():
        for _ in range(args.warmup):
            v.unit()
    shim = HeapShim.loaded()
    memory = {}
    for n, v in variants.items():
        memory[n] = {"allocator": unit_peak(v.steps, device)}
        memory[n]["all_threads"] = shim.peak(v.unit, memory_iters) if shim else None
        memory[n]["peak_bytes"] = (memory[n]["all_threads"] or memory[n]["allocator"])["peak_bytes"]
    steps = max(len(v.steps) for v in variants.values())
    timing = time_interleaved({n: v.unit for n, v in variants.items()}, args.repeats,
                              max(1, round(args.iters / steps)), device)
    out: dict[str, Any] = {"variants": {}, "ratios": {f"{a}/{b}": ratio(timing, a, b) for a, b in pairs}}
    for n, v in variants.items():
        out["variants"][n] = entry = {
            "timing": timing[n], "memory": memory[n], "reference": v.reference,
            "moved_from_init": any(not torch.equal(local(p.detach()), q) for p, q in zip(v.params, v.initial)),
            "grads_left": sum(p.grad is not None for p in v.params),
        }
        if v.reference:
            ref = variants[v.reference]
            entry["agreement"] = agreement(v.params, v.opt, ref.params, ref.opt)
    return out


def print_table(res: dict[str, Any], indent: str = "    ") -> None:
    """Median times, peaks and agreement of each variant of a :func:`measure` result, then its ratios."""
    print(f"{indent}{'variant':<26}{'median ms':>10}{'p25':>8}{'p75':>8}{'peak MiB':>10}{'faults/it':>11}"
          "  equals (bitwise)")
    for n, v in res["variants"].items():
        t, a = v["timing"], v.get("agreement")
        eq = "" if a is None else f"{v['reference']}: " + (
            "yes" if a["params_bitwise_equal"] and a.get("state_bitwise_equal", True) else
            f"NO (max |diff| {a['max_abs_diff']:.1e})")
        print(f"{indent}{n:<26}{t['median_s'] * 1e3:10.2f}{t['p25_s'] * 1e3:8.2f}{t['p75_s'] * 1e3:8.2f}"
              f"{mib(v['memory']['peak_bytes']):>10}{t.get('minor_faults_per_iter', float('nan')):>11.0f}  {eq}")
    print(f"{indent}{'time ratio':<44}{'of medians':>11}{'paired median (p25-p75)':>27}")
    for key, r in res["ratios"].items():
        paired = f"{r['paired_median']:.3f} ({r['paired_p25']:.3f}-{r['paired_p75']:.3f})"
        print(f"{indent}  {key:<42}{r['of_medians']:11.3f}{paired:>27}")


# -- a run: its environment, its ranks and its results file ---------------------------------------------------------
def _busy_s() -> tuple[float | None, float]:
    """CPU seconds the whole machine has been busy (None off Linux), and those of this process and its children."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None, own
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own


class Run:
    """Around a benchmark's measurements: threads, the allocator, whether other processes kept the CPUs busy
    (timings are comparable only when they did not), and the results file."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        torch.set_num_threads(args.threads)
        self.pinned = args.malloc == "pinned" and pin_malloc()
        self.start = (*_busy_s(), time.perf_counter())
        mode = "quick" if args.quick else "full"
        print(f"{name} ({mode}): torch {torch.__version__}, {args.device}, {args.threads} thread(s) per process, "
              f"malloc {args.malloc}, {args.repeats} interleaved repetitions", flush=True)

    def others_busy(self) -> float | None:
        """Share of the machine's CPU capacity that other processes used since the start."""
        busy, own = _busy_s()
        if busy is None or self.start[0] is None:
            return None
        wall = time.perf_counter() - self.start[2]
        return max(0.0, (busy - self.start[0]) - (own - self.start[1])) / (wall * (os.cpu_count() or 1))

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        """Write the machine, torch version, command line, configuration and ``figures`` to ``--out``."""
        args, others = self.args, self.others_busy()
        dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        result = {
            "benchmark": self.name, "mode": "quick" if args.quick else "full",
            "command": shlex.join(["python", "-m", f"benchmarks.{self.name}", *args.argv]),
            "machine": {"platform": platform.platform(), "device": dev, "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "config": {k: v for k, v in vars(args).items() if k != "argv"} | {"mallopt_pinned": self.pinned},
            "wall_s": time.perf_counter() - self.start[2], "other_processes_cpu_fraction": others, **figures,
        }
        if others is not None and others > 0.05:
            print(f"\nWARNING: other processes used {others:.0%} of the CPUs during the run: timings unreliable")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwall {result['wall_s']:.1f} s; results written to {args.out}")
        return result


def freeze_survivors() -> None:
    """Collect, then move every object still alive (the modules', and what earlier rows keep for good) to gc's
    permanent generation: each ``gc.collect()`` before a measured call then walks the objects made since, not
    torch's (0.14 s a collection with torch._dynamo loaded, several per planner row). Call it where nothing of a
    measurement exists yet: what it freezes is never collected."""
    gc.collect()
    gc.freeze()


def _rank_main(rank: int, fn: Callable[[int, argparse.Namespace], dict[str, Any]], args: argparse.Namespace,
               world: int, tmp: str) -> None:
    import torch.distributed as dist

    with quiet_kineto(os.path.join(tmp, f"rank{rank}.stderr")):
        try:
            freeze_survivors()
            torch.set_num_threads(args.threads)
            pinned = args.malloc == "pinned" and pin_malloc()  # a spawned interpreter starts with glibc's defaults
            if args.device == "cuda":
                torch.cuda.set_device(rank)
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world,
                                    store=dist.FileStore(os.path.join(tmp, "store"), world))
            try:
                result = {**fn(rank, args), "rank": rank, "mallopt_pinned": pinned}
            finally:
                dist.destroy_process_group()
        except Exception:
            result = {"error": traceback.format_exc()}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" in result:
        raise SystemExit(1)


def add_rank_memory_options(p: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that spawn ranks and take every thread's peak (:func:`spawn_ranks`)."""
    p.add_argument("--memory-iters", type=int, default=3, help="iterations of the all-thread peak, the median kept")
    p.add_argument("--no-heap-shim", action="store_true", help="peaks from the profiler alone (profiled thread)")


def spawn_ranks(fn: Callable[[int, argparse.Namespace], dict[str, Any]], args: argparse.Namespace
                ) -> tuple[list[dict[str, Any]], str | None]:
    """:func:`spawn` on ``args.world`` ranks with the heap shim unless ``--no-heap-shim``, saying so when the peaks
    fall back to the profiler."""
    ranks, no_shim = spawn(fn, args, args.world, heap_shim=not args.no_heap_shim)
    if no_shim and args.device == "cpu":
        print(f"heap shim not preloaded ({no_shim}): peaks from the profiler, which misses gloo's threads")
    return ranks, no_shim


def _each_row(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"rows": [args.row_fn(rank, argparse.Namespace(**{**vars(args), **row})) for row in args.rows]}


def spawn_rows(fn: Callable[[int, argparse.Namespace], dict[str, Any]], args: argparse.Namespace,
               rows: list[dict[str, Any]], world: int = 2, heap_shim: bool = False
               ) -> tuple[list[list[dict[str, Any]]], str | None]:
    """:func:`spawn` for several rows at the cost of one: ``fn(rank, args)`` once per row (a dict of attributes that
    replace ``args``'), one row after the other, on one group of ``world`` spawned ranks; each row's results (a list
    over the ranks), and why the heap shim is not preloaded. The interpreters' start, not the rows, is what a small
    spawned job costs."""
    ranks, no_shim = spawn(_each_row, argparse.Namespace(**vars(args), row_fn=fn, rows=rows), world, heap_shim)
    return [[r["rows"][k] for r in ranks] for k in range(len(rows))], no_shim


def spawn_rows_per_loop(fn: Callable[[int, argparse.Namespace], dict[str, Any]], args: argparse.Namespace,
                        rows: list[dict[str, Any]], loops: tuple[str, ...], world: int) -> list[dict[str, list[dict]]]:
    """:func:`spawn_rows` with the heap shim, each row once per loop (``args.loop``), all on one group of ranks
    (each row from its own baseline, the loops as further rows: a group per loop would pay the interpreters'
    start again); each row's results (a list over the ranks) per loop."""
    each, no_shim = spawn_rows(fn, args, [{**row, "loop": loop} for loop in loops for row in rows], world,
                               heap_shim=True)
    if no_shim:
        raise RuntimeError(f"heap shim not preloaded ({no_shim}): no per-rank peak of every thread")
    return [{loop: each[i * len(rows) + k] for i, loop in enumerate(loops)} for k in range(len(rows))]


def spawn(fn: Callable[[int, argparse.Namespace], dict[str, Any]], args: argparse.Namespace, world: int = 2,
          heap_shim: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """``fn(rank, args)`` on ``world`` spawned ranks with a process group (gloo; NCCL with --device cuda); their
    results, and why the heap shim is not preloaded (None when it is)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dist_optim_bench_") as tmp:
        shim, why = build_shim(tmp) if heap_shim and args.device == "cpu" else (None, "not asked for (or CUDA)")
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "DIST_OPTIM_BENCH_HEAP_SHIM")}
        if shim is not None:  # spawned interpreters inherit the environment
            os.environ["LD_PRELOAD"] = " ".join(x for x in (shim, saved["LD_PRELOAD"]) if x)
            os.environ["DIST_OPTIM_BENCH_HEAP_SHIM"] = shim
        failed: BaseException | None = None
        try:
            mp.spawn(_rank_main, args=(fn, args, world, tmp), nprocs=world, join=True)
        except Exception as e:  # the failed rank's traceback is in its result file
            failed = e
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} wrote no result ({failed!r})")
            with open(path) as f:
                results.append(json.load(f))
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors or failed is not None:
        raise RuntimeError("\n".join(errors) or repr(failed))
    return results, (None if shim else why)

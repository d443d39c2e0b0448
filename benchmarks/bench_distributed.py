"""Distributed CPU benchmark: in-backward AdamW against the standard loop under DDP and FSDP2, on 2 gloo ranks.

Run (full, about 75 seconds on 2 idle cores):
    python benchmarks/bench_distributed.py
Smoke run (about 10 seconds, a tiny model):
    python benchmarks/bench_distributed.py --quick --out /tmp/bench_distributed.json

Two processes (torch.multiprocessing.spawn, FileStore rendezvous, gloo), one intra-op thread each. Every rank builds
the same model, bench_core's many_small (default 16 x 512 wide: 66 tensors, 17.1 MiB of fp32 gradients) with its
layers regrouped into blocks (Linear, LayerNorm, GELU) plus the final Linear, so that FSDP2 can shard it block by
block, and feeds it its own input (8 rows, loss = model(x).square().mean()), the same input every iteration and for
every variant. Variants, each on its own deep copy of the initial model, all AdamW(lr, weight_decay, fused=True):

  ddp_view0_std   DDP(gradient_as_bucket_view=False); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
  ddp_view0_inb   DDP(gradient_as_bucket_view=False); InBackwardOptimizer(ddp_model, AdamW, ...); loss.backward()
  ddp_view1_std   the same two with gradient_as_bucket_view=True
  ddp_view1_inb
  fsdp2_std       fully_shard(each block), fully_shard(root); the standard loop on the sharded parameters
  fsdp2_inb       the same sharding; InBackwardOptimizer(model, AdamW, ...); loss.backward()
  fsdp2_hooks     the same sharding; torchtitan's optimizer in backward: one AdamW per parameter, stepped (and its
                  gradient set to None) in the parameter's register_post_accumulate_grad_hook; loss.backward()

Bucket sizes are scaled to the model: DDP bucket_cap_mb=1 (17 buckets; DDP's default 25 MiB would put 16 of the
17 MiB in one bucket, leaving nothing to free early) and the in-backward engine's bucket_cap_mb=0.5 under FSDP2
(about one block's shard; its default 4 MiB makes 3 buckets of an 8.5 MiB shard). Both are options.

Every variant runs the same iterations on the same data, so at the end each in-backward variant must equal its
standard loop under the same wrapper bitwise: every rank compares its local parameters (the replica under DDP, its
shards under FSDP2), both ranks are reported.

Measured per rank, in the same run (bench_core's functions are imported, not copied):
1. Step time: one whole iteration (forward + backward + step). After warm-up, interleaved and rotated repetitions of
   all seven variants (both ranks run the same order, so that their collectives match); per-iteration medians and
   quartiles; ratios of the medians and the median of per-repetition ratios (paired: the targets use these).
2. Peak memory of an iteration after the warm-up (optimizer state and DDP's bucket buffers exist, gradients are
   None), above its start, two ways:
   - bench_core's profiled_peak: torch.profiler's [memory] events. They are recorded only for the profiled thread
     (checked: the memory reporting is thread-local, and _ExperimentalConfig(profile_all_threads=True) records other
     threads' ops but drops every memory event). gloo runs collectives on its own work threads. Under DDP that does
     not matter: those threads allocate no tensor and every free happens on the main thread (net change 0, the
     figure is exact). Under FSDP2 it does: gloo's threads allocate (and free) ~67 tensor blocks, 33 MiB, per
     iteration of the full model, and free some of the blocks the main thread allocated, so the profiler's running
     sum ends MiBs high (its "net", 1-7 MiB) and its peaks and savings are off by as much, differently every run.
   - heap_shim.c (built with cc and LD_PRELOADed into the ranks unless --no-heap-shim; Linux/glibc): counts every
     thread's tensor blocks (torch's CPU allocator, posix_memalign) and every malloc'd byte. The median of
     --memory-iters iterations is the figure the targets use ("peak"); gloo's timing still moves it by a block now
     and then, which the median absorbs. Without a compiler the profiler's figure is used, with a warning.
   The saving is peak(standard) - peak(in-backward) under the same wrapper, as a fraction of the gradient bytes that
   wrapper's standard loop holds ("/held"): with gradient_as_bucket_view=False, the full local gradient (a second
   copy beside DDP's bucket buffers); with True, none (.grad are views of the persistent buckets: n/a); under FSDP2,
   the rank's sharded gradient. What remains of the peak with no gradient held at all (activations, backward
   temporaries, the wrapper's own buffers) cannot be saved, so the saving is also given as a fraction of the
   attainable one ("/attn"), std peak - floor peak, the floor measured by another variant: ddp_view1_std for
   gradient_as_bucket_view=False (the same buckets and no second copy), fsdp2_hooks for FSDP2 (each gradient freed
   right after its own step).

Targets set by the project: in-backward no slower than the standard loop under the same wrapper (paired median
ratio <= 1.0 on each rank); peak saving >= 0.9 of the gradient bytes that wrapper's standard loop holds.

Output: a table on stdout and a JSON file (default benchmarks/results/bench_distributed.json, --out to change it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import dist_optim  # noqa: E402
from bench_core import (  # noqa: E402
    LR,
    WEIGHT_DECAY,
    Contention,
    Run,
    _cpu_busy_s,
    _frac,
    _mib,
    many_small,
    pin_malloc,
    profiled_peak,
    ratio,
    time_interleaved,
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_distributed.json")
WORLD = 2

TARGET_RATIO_MAX = 1.0
TARGET_SAVING_MIN = 0.9

# name -> (wrapper, loop); the order keeps each standard loop next to its in-backward counterparts in a repetition
VARIANTS: dict[str, tuple[str, str]] = {
    "ddp_view0_std": ("ddp_view0", "standard"),
    "ddp_view0_inb": ("ddp_view0", "in_backward"),
    "ddp_view1_std": ("ddp_view1", "standard"),
    "ddp_view1_inb": ("ddp_view1", "in_backward"),
    "fsdp2_std": ("fsdp2", "standard"),
    "fsdp2_inb": ("fsdp2", "in_backward"),
    "fsdp2_hooks": ("fsdp2", "per_param_hooks"),
}
# The lowest peak freeing gradients early can reach under each wrapper, measured by another variant: what remains
# of the iteration's peak (activations, backward temporaries, the wrapper's own buffers) with no gradient held.
FLOORS = {"ddp_view0": "ddp_view1_std", "ddp_view1": "ddp_view1_std", "fsdp2": "fsdp2_hooks"}
FLOOR_WHAT = {
    "ddp_view0": "ddp_view1_std: the same buckets, .grad views of them, no second copy",
    "ddp_view1": "ddp_view1_std itself: nothing to free",
    "fsdp2": "fsdp2_hooks: each sharded gradient freed right after its own step",
}
WRAPPERS = {
    "ddp_view0": "DDP, gradient_as_bucket_view=False",
    "ddp_view1": "DDP, gradient_as_bucket_view=True",
    "fsdp2": "FSDP2, fully_shard per block + root",
}


def standard_of(name: str) -> str:
    return f"{VARIANTS[name][0]}_std"


# -- model ----------------------------------------------------------------------------------------------------------
def blocked_many_small(width: int, depth: int) -> nn.Sequential:
    """bench_core's many_small (same parameters, same initial values under the same seed), its layers regrouped into
    ``depth`` blocks of (Linear, LayerNorm, GELU) plus the final Linear, so that FSDP2 can shard block by block."""
    layers = list(many_small(width, depth))
    blocks: list[nn.Module] = [nn.Sequential(*layers[3 * k : 3 * k + 3]) for k in range(depth)]
    return nn.Sequential(*blocks, layers[-1])


def model_spec(args: argparse.Namespace) -> dict[str, Any]:
    w, d = args.width, args.depth
    return {"width": w, "depth": d,
            "desc": f"{d}x(Linear {w}x{w} + LayerNorm {w} + GELU) + Linear {w}x{w}, fully_shard per block"}


# -- variants -------------------------------------------------------------------------------------------------------
def _adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _inb(model: nn.Module, args: argparse.Namespace) -> dist_optim.InBackwardOptimizer:
    kw: dict[str, Any] = {}
    if args.bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = args.bucket_cap_mb
    return dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True, **kw)


def per_param_hooks(model: nn.Module) -> dict[torch.Tensor, torch.optim.Optimizer]:
    """torchtitan's optimizer-in-backward: one optimizer per parameter, stepped in its post-accumulate-grad hook."""
    optims = {p: _adamw([p]) for p in model.parameters() if p.requires_grad}

    def hook(p: torch.Tensor) -> None:
        optims[p].step()
        optims[p].zero_grad()

    for p in optims:
        p.register_post_accumulate_grad_hook(hook)
    return optims


def build_variant(name: str, base: nn.Module, mesh: Any, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The wrapped model and its optimizer object(s) of variant ``name``."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapper, loop = VARIANTS[name]
    module = copy.deepcopy(base)
    if wrapper.startswith("ddp"):
        kw = {} if args.ddp_bucket_cap_mb is None else {"bucket_cap_mb": args.ddp_bucket_cap_mb}
        model: nn.Module = DDP(module, gradient_as_bucket_view=wrapper == "ddp_view1", **kw)
    else:
        for block in list(module)[:-1]:
            fully_shard(block, mesh=mesh)
        model = fully_shard(module, mesh=mesh)
    if loop == "standard":
        return model, _adamw(model.parameters())
    if loop == "in_backward":
        return model, _inb(model, args)
    return model, per_param_hooks(model)


def iteration(model: nn.Module, opt: Any, loop: str, x: torch.Tensor) -> Callable[[], None]:
    def standard() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def in_backward() -> None:
        model(x).square().mean().backward()

    return standard if loop == "standard" else in_backward


# -- helpers for one rank -------------------------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(params: list[torch.Tensor]) -> int:
    return sum(local(p).numel() * local(p).element_size() for p in params)


def bucket_local_bytes(opt: dist_optim.InBackwardOptimizer) -> list[int]:
    """bench_core.bucket_bytes counts a DTensor's global size; a rank steps (and frees) its local shards."""
    buckets = list(opt._engine.buckets) + list(opt._engine.comm_buckets.values())
    return [local_bytes(b.params) for b in buckets]


def ddp_bucket_bytes(model: nn.Module) -> list[int]:
    """DDP's (rebuilt) bucket sizes, from its logging data; [] where this torch does not report them."""
    try:
        data = model._get_ddp_logging_data()
    except Exception:  # private API
        return []
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).split(",") if s.strip()]


class HeapShim:
    """heap_shim.c, LD_PRELOADed into this rank: live bytes and peaks of every thread's allocations."""

    FIELDS = ("all_current", "all_peak", "tensor_current", "tensor_peak", "off_main_alloc_bytes",
              "off_main_alloc_count", "off_main_free_bytes", "off_main_free_count")

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)  # the same handle as the preloaded copy
        for f in self.FIELDS:
            getattr(self.lib, f"shim_{f}").restype = ctypes.c_long

    def get(self, f: str) -> int:
        return getattr(self.lib, f"shim_{f}")()

    def measure(self, fn: Callable[[], None], times: int) -> list[dict[str, int]]:
        """``times`` calls of ``fn``, each: peaks and net change above its start, as profiled_peak measures them, but
        of every thread. Python's cyclic GC is paused during the calls (profiled_peak has just collected)."""
        gc_was = gc.isenabled()
        gc.disable()
        out = []
        try:
            for _ in range(times):
                self.lib.shim_reset()
                t0, a0 = self.get("tensor_current"), self.get("all_current")
                fn()
                out.append({
                    "peak_bytes": self.get("tensor_peak") - t0, "net_bytes": self.get("tensor_current") - t0,
                    "heap_peak_bytes": self.get("all_peak") - a0, "heap_net_bytes": self.get("all_current") - a0,
                    "off_main_alloc_bytes": self.get("off_main_alloc_bytes"),
                    "off_main_allocs": self.get("off_main_alloc_count"),
                    "off_main_free_bytes": self.get("off_main_free_bytes"),
                    "off_main_frees": self.get("off_main_free_count"),
                })
        finally:
            if gc_was:
                gc.enable()
        return out


def median_record(records: list[dict[str, int]], key: str) -> dict[str, int]:
    """The record whose ``key`` is the median (the lower one of an even count)."""
    return sorted(records, key=lambda r: r[key])[(len(records) - 1) // 2]


# -- one rank -------------------------------------------------------------------------------------------------------
def rank_main(rank: int, store_path: str, args: argparse.Namespace, result_dir: str,
              run: Callable[[int, str, argparse.Namespace], dict[str, Any]] | None = None) -> None:
    """One spawned rank: ``run`` (default :func:`run_rank`), its result or traceback written as JSON."""
    result: dict[str, Any]
    with filtered_stderr(os.path.join(result_dir, f"rank{rank}.stderr")):
        try:
            result = (run or run_rank)(rank, store_path, args)
        except Exception:
            result = {"error": traceback.format_exc()}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" in result:
        raise SystemExit(1)


@contextlib.contextmanager
def filtered_stderr(path: str) -> Iterator[None]:
    """Kineto writes two "USDT: ... profiler_start/stop" lines to fd 2 for every profiled call: collect the rank's
    stderr in a file and pass on everything else when done."""
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
            rest = [ln for ln in f.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_NOISE.search(ln)]
            sys.stderr.write("".join(rest))
            sys.stderr.flush()


_KINETO_NOISE = re.compile(r"USDT:.*ActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)")


def run_rank(rank: int, store_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    phases = {"started": time.perf_counter()}
    torch.set_num_threads(args.threads)
    pinned = pin_malloc() if args.malloc == "pinned" else None
    shim_path = os.environ.get("DIST_OPTIM_BENCH_HEAP_SHIM")
    shim = HeapShim(shim_path) if shim_path else None
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        phases["process_group"] = time.perf_counter()
        torch.manual_seed(0)
        base = blocked_many_small(args.width, args.depth)  # the same on every rank
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(100 + rank))  # this rank's

        models: dict[str, nn.Module] = {}
        opts: dict[str, Any] = {}
        runs: dict[str, Callable[[], None]] = {}
        initial: dict[str, list[torch.Tensor]] = {}
        for name, (_, loop) in VARIANTS.items():
            models[name], opts[name] = build_variant(name, base, mesh, args)
            runs[name] = iteration(models[name], opts[name], loop, x)
            if loop == "standard":
                initial[name] = [local(p.detach()).clone() for p in models[name].parameters()]
        phases["built"] = time.perf_counter()
        # Warm-up: optimizer state, DDP's rebuilt buckets, the engine's learnt buckets, allocator, kernels.
        for name in VARIANTS:
            for _ in range(args.warmup):
                runs[name]()
        dist.barrier()
        phases["warm"] = time.perf_counter()
        profiler: dict[str, Any] = {}
        all_threads: dict[str, Any] | None = {} if shim else None
        for name in VARIANTS:
            profiler[name] = profiled_peak(runs[name])  # collects garbage first
            if shim:  # gloo's threads make this figure vary a little between iterations: several, the median
                each = shim.measure(runs[name], args.memory_iters)
                all_threads[name] = {**median_record(each, "peak_bytes"),
                                     "peak_bytes_each": [e["peak_bytes"] for e in each]}
        dist.barrier()
        phases["memory"] = time.perf_counter()
        timing = time_interleaved(runs, args, tuple(VARIANTS))
        dist.barrier()
        phases["timed"] = time.perf_counter()

        agreement = {}
        for name in VARIANTS:
            ps = [local(p.detach()) for p in models[name].parameters()]
            ref = [local(p.detach()) for p in models[standard_of(name)].parameters()]
            agreement[name] = {
                "reference": standard_of(name),
                "params_bitwise_equal": all(torch.equal(a, b) for a, b in zip(ps, ref)),
                "max_abs_diff": max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(ps, ref)),
                "grads_left": sum(p.grad is not None for p in models[name].parameters()),
            }
        moved = {name: any(not torch.equal(local(p.detach()), q) for p, q in zip(models[name].parameters(), init))
                 for name, init in initial.items()}

        ddp_params = list(models["ddp_view0_std"].parameters())
        fsdp_params = list(models["fsdp2_std"].parameters())
        info = {
            "grad_bytes_local_replica": local_bytes(ddp_params),
            "grad_bytes_sharded": local_bytes(fsdp_params),
            "largest_tensor_bytes_sharded": max(local_bytes([p]) for p in fsdp_params),
            "ddp_bucket_bytes": {w: ddp_bucket_bytes(models[f"{w}_std"]) for w in ("ddp_view0", "ddp_view1")},
            "inb_bucket_bytes": {n: bucket_local_bytes(opts[n]) for n in ("ddp_view0_inb", "ddp_view1_inb",
                                                                         "fsdp2_inb")},
        }
        return {"rank": rank, "timing": timing, "profiler": profiler, "all_threads": all_threads,
                "agreement": agreement, "standard_moved_from_init": moved, "info": info, "mallopt": pinned,
                "phase_s": {k: round(t - phases["started"], 3) for k, t in phases.items()}}
    finally:
        dist.destroy_process_group()


# -- heap shim ------------------------------------------------------------------------------------------------------
SHIM_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_shim.c")


def build_shim(tmp: str) -> tuple[str | None, str]:
    """Compile heap_shim.c into ``tmp``: (the library, "") or (None, why not)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None, "not Linux with glibc"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC)"
    lib = os.path.join(tmp, "libheap_shim.so")
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, SHIM_SRC, "-lpthread"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"{cc} failed: {proc.stderr.strip()[-500:]}"
    return lib, ""


# -- the whole run --------------------------------------------------------------------------------------------------
def _tree_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class TreeContention(Contention):
    """bench_core's contention figure, counting the rank processes (our children, once joined) as ours."""

    def __init__(self) -> None:
        super().__init__()
        self.own0 = _tree_cpu_s()

    def others_fraction(self) -> float | None:
        busy = _cpu_busy_s()
        if busy is None or self.busy0 is None:
            return None
        others = (busy - self.busy0) - (_tree_cpu_s() - self.own0)
        return max(0.0, others) / ((time.perf_counter() - self.wall0) * (os.cpu_count() or 1))


class SpawnRun(Run):
    """bench_core's Run (idle check, wall time, contention); each rank pins its own allocator, as a spawned
    interpreter starts with glibc's defaults."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.contention = TreeContention()


def spawn_ranks(args: argparse.Namespace, tmp: str, shim: str | None,
                run: Callable[[int, str, argparse.Namespace], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``run`` (default :func:`run_rank`) on WORLD spawned ranks; their results, or the failed ranks' tracebacks."""
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "DIST_OPTIM_BENCH_HEAP_SHIM")}
    if shim is not None:  # spawned interpreters inherit the environment
        os.environ["LD_PRELOAD"] = " ".join(x for x in (shim, saved["LD_PRELOAD"]) if x)
        os.environ["DIST_OPTIM_BENCH_HEAP_SHIM"] = shim
    failed: BaseException | None = None
    try:
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), args, tmp, run), nprocs=WORLD, join=True)
    except Exception as e:  # a rank failed: its traceback is in its result file
        failed = e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results = []
    for r in range(WORLD):
        path = os.path.join(tmp, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {r} wrote no result ({failed!r})")
        with open(path) as f:
            results.append(json.load(f))
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors or failed is not None:
        raise RuntimeError("\n".join(errors) or repr(failed))
    return results


def memory_of(rank: dict[str, Any], name: str) -> dict[str, Any]:
    """The figure the targets use: the all-thread tensor peak where the shim ran, else the profiler's."""
    if rank["all_threads"] is not None:
        return {"source": "all_threads", **rank["all_threads"][name]}
    return {"source": "profiler", **rank["profiler"][name]}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per wrapper: per-rank times, peaks, ratios, savings and agreement; targets judged on every rank."""
    info0 = ranks[0]["info"]
    out: dict[str, Any] = {}
    for wrapper, desc in WRAPPERS.items():
        std = f"{wrapper}_std"
        if wrapper == "ddp_view0":
            held = [r["info"]["grad_bytes_local_replica"] for r in ranks]
            held_what = "the full local gradient in .grad, a second copy beside DDP's bucket buffers"
        elif wrapper == "ddp_view1":
            held = [0 for _ in ranks]
            held_what = "none: .grad are views of DDP's bucket buffers, which persist"
        else:
            held = [r["info"]["grad_bytes_sharded"] for r in ranks]
            held_what = "the rank's sharded gradient"
        floor = FLOORS[wrapper]
        variants: dict[str, Any] = {}
        for n in (n for n, (w, _) in VARIANTS.items() if w == wrapper):
            v: dict[str, Any] = {"loop": VARIANTS[n][1], "per_rank": []}
            for r in ranks:
                t = r["timing"][n]
                v["per_rank"].append({
                    **{k: t[k] for k in ("median_s", "p25_s", "p75_s", "samples_s", "minor_faults_per_iter_median")},
                    "memory": memory_of(r, n), "profiler": r["profiler"][n],
                    "all_threads": r["all_threads"][n] if r["all_threads"] else None,
                    "grads_left": r["agreement"][n]["grads_left"],
                })
            if n == std:
                v["moved_from_init"] = all(r["standard_moved_from_init"][n] for r in ranks)
            else:
                v["reference"] = std
                v["ratio_vs_standard"] = [ratio(r["timing"], n, std) for r in ranks]
                savings = []
                for k, r in enumerate(ranks):
                    achieved = memory_of(r, std)["peak_bytes"] - memory_of(r, n)["peak_bytes"]
                    attainable = memory_of(r, std)["peak_bytes"] - memory_of(r, floor)["peak_bytes"]
                    s: dict[str, Any] = {
                        "source": memory_of(r, n)["source"], "achieved_bytes": achieved, "held_grad_bytes": held[k],
                        "fraction": achieved / held[k] if held[k] > 0 else None,
                        "attainable_bytes": attainable,
                        "fraction_of_attainable": achieved / attainable if attainable > 0 else None,
                        "profiler_achieved_bytes": r["profiler"][std]["peak_bytes"] - r["profiler"][n]["peak_bytes"],
                    }
                    if r["all_threads"]:
                        s["heap_achieved_bytes"] = (r["all_threads"][std]["heap_peak_bytes"]
                                                    - r["all_threads"][n]["heap_peak_bytes"])
                    savings.append(s)
                v["memory_saving"] = savings
                v["agreement"] = {
                    "params_bitwise_equal": all(r["agreement"][n]["params_bitwise_equal"] for r in ranks),
                    "max_abs_diff": max(r["agreement"][n]["max_abs_diff"] for r in ranks),
                    "per_rank": [r["agreement"][n] for r in ranks],
                }
                ratios = [x["paired_median"] for x in v["ratio_vs_standard"]]
                fracs = [s["fraction"] for s in savings]
                v["targets"] = {
                    "not_slower_than_standard_on_every_rank": all(x <= TARGET_RATIO_MAX for x in ratios),
                    "saving_at_least_0.9_of_held_grads_on_every_rank": (
                        None if any(f is None for f in fracs) else all(f >= TARGET_SAVING_MIN for f in fracs)
                    ),
                }
            variants[n] = v
        extra: dict[str, Any] = {}
        if wrapper.startswith("ddp"):
            extra["ddp_bucket_bytes"] = info0["ddp_bucket_bytes"][wrapper]
        else:
            b = info0["inb_bucket_bytes"]["fsdp2_inb"]
            extra["inb_bucket_bytes_rank0"] = b
            # what freeing at once could save at most: all but the largest bucket (tensor) in flight
            extra["ceiling_fraction_rank0"] = {
                "fsdp2_inb": 1 - max(b) / held[0], "fsdp2_hooks": 1 - info0["largest_tensor_bytes_sharded"] / held[0]}
        out[wrapper] = {"description": desc, "held_grad_bytes_per_rank": held, "held_grad_bytes_are": held_what,
                        "floor_variant": floor, "floor_is": FLOOR_WHAT[wrapper], "variants": variants, **extra}
    return out


def print_report(res: dict[str, Any]) -> None:
    m = res["model"]
    shim = res["config"]["all_thread_memory"]
    print(f"\n=== {m['desc']}: {m['n_tensors']} tensors, {m['n_params'] / 1e6:.2f} M params, "
          f"{_mib(m['grad_bytes'])} MiB of gradients per replica, {_mib(m['grad_bytes_sharded_rank0'])} MiB sharded "
          f"on rank 0; batch {m['batch']} per rank")
    src = ("tensor bytes of all threads (heap shim)" if shim else
           "the profiler's (profiled thread only: the heap shim did not run)")
    print(f"    peak = one iteration's allocator peak above its start, {src}; 'prof' = torch.profiler's figure "
          "(profiled thread only) and its net change in brackets; 'heap' = every malloc of every thread")
    for wrapper, w in res["wrappers"].items():
        print(f"\n  -- {w['description']}; gradient bytes its standard loop holds per rank: "
              f"{', '.join(_mib(h) for h in w['held_grad_bytes_per_rank'])} MiB ({w['held_grad_bytes_are']})")
        first_inb = next(v for v in w["variants"].values() if "memory_saving" in v)
        att = first_inb["memory_saving"]  # the same std and floor for every variant of the wrapper
        print(f"     floor: {w['floor_is']}; attainable saving (std peak - floor peak) per rank: "
              f"{', '.join(_mib(s['attainable_bytes']) for s in att)} MiB")
        if "ddp_bucket_bytes" in w:
            print(f"     DDP buckets (MiB): {', '.join(_mib(b) for b in w['ddp_bucket_bytes']) or 'n/a'}")
        else:
            b, c = w["inb_bucket_bytes_rank0"], w["ceiling_fraction_rank0"]
            print(f"     in-backward buckets on rank 0: {len(b)}, largest {_mib(max(b))} MiB of local shards; saving "
                  f"ceiling (held - largest bucket, or tensor, in flight) {c['fsdp2_inb']:.3f} in-backward, "
                  f"{c['fsdp2_hooks']:.3f} hooks")
        print(f"     {'variant':<14}{'rank':>5}{'median ms':>10}{'p25':>8}{'p75':>8}{'/std paired (p25-p75)':>23}"
              f"{'peak':>7}{'saved':>7}{'/held':>7}{'/attn':>7}{'prof (net)':>15}{'saved':>7}"
              + (f"{'heap':>7}{'saved':>7}" if shim else "") + "  = std bitwise")
        for n, v in w["variants"].items():
            for k, pr in enumerate(v["per_rank"]):
                r = v.get("ratio_vs_standard")
                paired = f"{r[k]['paired_median']:.3f} ({r[k]['paired_p25']:.3f}-{r[k]['paired_p75']:.3f})" if r else ""
                s = v["memory_saving"][k] if "memory_saving" in v else None
                saved = (f"{_mib(s['achieved_bytes']):>7}{_frac(s['fraction']):>7}"
                         f"{_frac(s['fraction_of_attainable']):>7}" if s else f"{'':>21}")
                prof = f"{_mib(pr['profiler']['peak_bytes'])} ({_mib(pr['profiler']['net_bytes'])})"
                psaved = f"{_mib(s['profiler_achieved_bytes']):>7}" if s else f"{'':>7}"
                heap = ""
                if shim:
                    heap = f"{_mib(pr['all_threads']['heap_peak_bytes']):>7}" + (
                        f"{_mib(s['heap_achieved_bytes']):>7}" if s else f"{'':>7}")
                eq = ""
                if "agreement" in v:
                    a = v["agreement"]["per_rank"][k]
                    eq = "yes" if a["params_bitwise_equal"] else f"NO ({a['max_abs_diff']:.1e})"
                print(f"     {n if k == 0 else '':<14}{k:>5}{pr['median_s'] * 1e3:10.2f}{pr['p25_s'] * 1e3:8.2f}"
                      f"{pr['p75_s'] * 1e3:8.2f}{paired:>23}{_mib(pr['memory']['peak_bytes']):>7}{saved}{prof:>15}"
                      f"{psaved}{heap}  {eq}")
    if shim:
        print("\n  -- other threads (gloo's work threads), per rank: tensor blocks they allocated / freed during the "
              "iteration (count, MiB); the profiler sees neither, and a free it misses leaves its running sum high")
        for w in res["wrappers"].values():
            for n, v in w["variants"].items():
                cells = [f"alloc {a['off_main_allocs']} / {_mib(a['off_main_alloc_bytes'])}, "
                         f"free {a['off_main_frees']} / {_mib(a['off_main_free_bytes'])}"
                         for a in (pr["all_threads"] for pr in v["per_rank"])]
                print(f"     {n:<14}" + "  |  ".join(cells))
    print("\n  -- targets, on every rank: time = paired median ratio <= 1.0 against the standard loop under the same "
          "wrapper; memory = peak saving >= 0.9 of the gradient bytes that loop holds")
    for w in res["wrappers"].values():
        for n, v in w["variants"].items():
            if "targets" in v:
                t = v["targets"]
                mem = {None: "n/a", True: "met", False: "MISSED"}[t["saving_at_least_0.9_of_held_grads_on_every_rank"]]
                print(f"     {n:<14} time {'met' if t['not_slower_than_standard_on_every_rank'] else 'MISSED':<8}"
                      f"memory {mem}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few repetitions (a smoke run, < 20 s)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT})")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (default 1)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 25; quick 2)")
    p.add_argument("--iters", type=int, default=None, help="iterations per timed block (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations per variant (default 3; quick 2)")
    p.add_argument("--batch", type=int, default=8, help="input rows per rank and iteration (default 8)")
    p.add_argument("--width", type=int, default=None, help="many_small width (default 512; quick 128)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks (default 16; quick 8)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="InBackwardOptimizer bucket_cap_mb under FSDP2 (default 0.5: about one block's shard, scaled "
                        "to the model as the engine's 4 MiB is to a large one; quick 0.02)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None,
                   help="DDP bucket_cap_mb (default 1: 17 buckets, scaled to the model as DDP's 25 MiB is to a "
                        "400 MiB one; quick 0.1)")
    p.add_argument("--memory-iters", type=int, default=3,
                   help="iterations whose all-thread peak is measured, the median reported (default 3)")
    p.add_argument("--malloc", choices=("pinned", "glibc"), default="pinned",
                   help="as bench_core (each rank pins its own allocator); default pinned")
    p.add_argument("--no-heap-shim", action="store_true",
                   help="do not LD_PRELOAD heap_shim.c: peaks then come from the profiler alone (profiled thread)")
    a = p.parse_args(argv)
    a.reps = a.reps or (2 if a.quick else 25)
    a.iters = a.iters or (1 if a.quick else 3)
    a.warmup = a.warmup or (2 if a.quick else 3)
    a.width = a.width or (128 if a.quick else 512)
    a.depth = a.depth or (8 if a.quick else 16)
    if a.bucket_cap_mb is None:
        a.bucket_cap_mb = 0.02 if a.quick else 0.5
    if a.ddp_bucket_cap_mb is None:
        a.ddp_bucket_cap_mb = 0.1 if a.quick else 1.0
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not dist.is_available():
        raise SystemExit("this torch build has no torch.distributed")
    run = SpawnRun(args)
    with tempfile.TemporaryDirectory(prefix="bench_distributed_") as tmp:
        shim, why = (None, "--no-heap-shim") if args.no_heap_shim else build_shim(tmp)
        if shim is None and not args.no_heap_shim:
            print(f"heap shim not built ({why}): peaks from the profiler alone, which misses gloo's threads",
                  file=sys.stderr)
        print(f"bench_distributed ({'quick' if args.quick else 'full'}): torch {torch.__version__}, {WORLD} gloo "
              f"ranks x {args.threads} thread(s), malloc {args.malloc}, heap shim {'on' if shim else 'off'}, "
              f"{args.reps} interleaved reps x {args.iters} iterations, medians per rank; AdamW(fused) lr {LR} "
              f"wd {WEIGHT_DECAY}", flush=True)
        ranks = spawn_ranks(args, tmp, shim)

    torch.manual_seed(0)
    params = list(blocked_many_small(args.width, args.depth).parameters())
    spec = model_spec(args)
    results: dict[str, Any] = {
        "benchmark": "bench_distributed",
        "mode": "quick" if args.quick else "full",
        "config": {
            "world_size": WORLD, "backend": "gloo", "threads_per_rank": args.threads, "reps": args.reps,
            "iters_per_block": args.iters, "warmup": args.warmup, "batch_per_rank": args.batch, "lr": LR,
            "weight_decay": WEIGHT_DECAY, "optimizer": "AdamW(fused=True)", "inb_bucket_cap_mb": args.bucket_cap_mb,
            "ddp_bucket_cap_mb": args.ddp_bucket_cap_mb, "malloc": args.malloc,
            "mallopt_per_rank": [r["mallopt"] for r in ranks], "all_thread_memory": shim is not None,
            "heap_shim_absent_because": None if shim else why,
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "targets": {"in_backward/standard max (paired median, every rank)": TARGET_RATIO_MAX,
                    "saving fraction of held gradient bytes min": TARGET_SAVING_MIN},
        "model": {
            "desc": spec["desc"], "width": spec["width"], "depth": spec["depth"], "batch": args.batch,
            "n_tensors": len(params), "n_params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes_sharded_rank0": ranks[0]["info"]["grad_bytes_sharded"],
        },
        "wrappers": summarize(ranks),
    }
    print_report(results)
    run.finish(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

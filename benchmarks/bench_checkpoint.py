"""Checkpoint benchmark: dist_optim.checkpoint against torch.distributed.checkpoint (DCP) used directly, FSDP2 on 2
gloo ranks.

Run (full, about a minute on 2 idle cores):
    python benchmarks/bench_checkpoint.py
Smoke run (a few seconds, a tiny model):
    python benchmarks/bench_checkpoint.py --quick --out /tmp/bench_checkpoint.json

Two processes (bench_distributed's spawn: FileStore rendezvous, gloo), one intra-op thread each. Every rank builds
bench_distributed's blocked many_small (default 10 x 1024 wide: 32 tensors, 44 MiB of fp32 parameters),
``fully_shard`` per block then the root, and trains it two steps on its own input so that AdamW's state exists
(exp_avg and exp_avg_sq: twice the parameters; per rank 22 MiB of parameter shards and 44 MiB of state). Sides:

  ours  dist_optim.InBackwardOptimizer(model, AdamW, fused=True) and a CosineAnnealingLR;
        save: dist_optim.checkpoint.save(path, model=, optimizer=, schedulers=, step=)
        load: dist_optim.checkpoint.load(path, model=, optimizer=, schedulers=) into a fresh model and optimizer
  dcp   torch.optim.AdamW(fused=True) (DCP's state-dict helpers are meant for standard optimizers), the torch way:
        save: msd, osd = get_state_dict(model, opt); dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        load: get_state_dict on a fresh model and optimizer (torch fills an empty optimizer's state by a fake step
              there, as documented), dcp.load(...), set_state_dict(...)
  Both write through DCP's FileSystemWriter with its defaults (one file per rank, fsync'd). Ours also writes the
  scheduler, each rank's RNG states, dist_optim.json and COMMITTED, and commits by renaming <path>.partial.

Measured per rank, wall time from a barrier to the call's return (the collectives inside make both ranks wait for
each other), after one untimed warm-up repetition:
1. save and load: --reps repetitions, each saving both sides into fresh folders and then loading both, the order of
   the sides alternating from one repetition to the next; medians and quartiles, and ratios ours/dcp of the medians
   and the median of the per-repetition ratios (bench_core's ``ratio``). Every load is checked against the model
   and optimizer that were saved: local parameter shards and optimizer state bitwise, lr.
2. bytes: each rank sums the files it wrote (DCP names them ``__<rank>_<n>.distcp``); the files rank 0 writes for
   everyone (``.metadata``; ours also ``dist_optim.json`` and ``COMMITTED``) are reported apart.
3. async save: ``save(..., async_save=True)`` and ``dcp.async_save(...)``, both on a gloo group of their own (the
   upload runs collectives on a background thread): the time until the call returns (the state is staged: copied)
   and until the save has finished (``wait()`` / ``result()``; ours includes rank 0's commit).

Output: a table on stdout and a JSON file (default benchmarks/results/bench_checkpoint.json, --out to change it).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

import dist_optim  # noqa: E402
from bench_core import LR, WEIGHT_DECAY, _mib, pin_malloc, quartiles, ratio  # noqa: E402
from bench_distributed import WORLD, SpawnRun, blocked_many_small, local, local_bytes, spawn_ranks  # noqa: E402
from dist_optim import checkpoint  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_checkpoint.json")
SIDES = ("ours", "dcp")
STEP = 2  # training steps before the checkpoint
SHARED_FILES = {"ours": (".metadata", "dist_optim.json", "COMMITTED"), "dcp": (".metadata",)}


# -- the two sides --------------------------------------------------------------------------------------------------
def build(side: str, base: nn.Module, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh FSDP2 copy of ``base``, its optimizer (in backward for ours, standard for dcp) and scheduler."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for block in list(model)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"lr": LR, "weight_decay": WEIGHT_DECAY, "fused": True}
    if side == "ours":
        opt: torch.optim.Optimizer = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), **kw)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)


def train(side: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor) -> None:
    for _ in range(STEP):
        model(x).square().mean().backward()
        if side == "dcp":
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save(side: str, path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
         async_group: Any = None) -> Any:
    """Save; with ``async_group``, asynchronously over that group, returning what to wait on."""
    if side == "ours":
        return checkpoint.save(path, model=model, optimizer=opt, schedulers=sched, step=STEP,
                               async_save=async_group is not None, process_group=async_group)
    state = dcp_state(model, opt)
    if async_group is not None:
        return dcp.async_save(state, checkpoint_id=path, process_group=async_group)
    dcp.save(state, checkpoint_id=path)
    return None


def wait(side: str, handle: Any) -> None:
    if side == "ours":
        handle.wait()
    else:  # a Future, or an AsyncSaveResponse where a stager staged asynchronously
        getattr(handle, "upload_completion", handle).result()


def load(side: str, path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    if side == "ours":
        checkpoint.load(path, model=model, optimizer=opt, schedulers=sched)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def differences(saved: tuple[nn.Module, torch.optim.Optimizer], loaded: tuple[nn.Module, torch.optim.Optimizer]
                ) -> list[str]:
    """What differs between the saved and the loaded model and optimizer, on this rank ([] when nothing)."""
    (m0, o0), (m1, o1) = saved, loaded
    out = []
    for (name, p), q in zip(m0.named_parameters(), m1.parameters()):
        if not torch.equal(local(p.detach()), local(q.detach())):
            out.append(f"parameter {name}")
        s0, s1 = o0.state.get(p, {}), o1.state.get(q, {})
        if s0.keys() != s1.keys():
            out.append(f"optimizer state keys of {name}: {sorted(s0)} vs {sorted(s1)}")
            continue
        for k, v in s0.items():
            w = s1[k]
            same = torch.equal(local(v), local(w)) if isinstance(v, torch.Tensor) else v == w
            if not same:
                out.append(f"optimizer state {k!r} of {name}")
    lrs = ([g["lr"] for g in o.param_groups] for o in (o0, o1))
    if next(lrs) != next(lrs):
        out.append("lr")
    return out


# -- measuring ------------------------------------------------------------------------------------------------------
def start() -> float:
    """Collect garbage, then the clock once every rank is there."""
    gc.collect()
    dist.barrier()
    return time.perf_counter()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds from a barrier to ``fn``'s return."""
    t0 = start()
    fn()
    return time.perf_counter() - t0


def files_written(folder: Path, rank: int) -> dict[str, Any]:
    """This rank's data files in ``folder`` (count, bytes) and the sizes of the files written for all ranks."""
    own = re.compile(rf"^__{rank}_\d+\.distcp$")
    mine = [f.stat().st_size for f in folder.iterdir() if own.match(f.name)]
    shared = {f.name: f.stat().st_size for f in folder.iterdir() if not f.name.endswith(".distcp")}
    return {"rank_files": len(mine), "rank_bytes": sum(mine), "shared_bytes": shared}


def stats(samples: list[float]) -> dict[str, Any]:
    q1, med, q3 = quartiles(samples)
    return {"median_s": med, "p25_s": q1, "p75_s": q3, "samples_s": samples}


def remove(paths: list[Path]) -> None:
    """Rank 0 deletes the folders once every rank is done with them."""
    dist.barrier()
    if dist.get_rank() == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def run_rank(rank: int, store_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    phases = {"started": time.perf_counter()}
    torch.set_num_threads(args.threads)
    pinned = pin_malloc() if args.malloc == "pinned" else None
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        async_group = dist.new_group(backend="gloo")
        root = Path(args.dir)
        torch.manual_seed(0)
        base = blocked_many_small(args.width, args.depth)  # the same on every rank
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(100 + rank))
        trained = {}
        for side in SIDES:
            model, opt, sched = trained[side] = build(side, base, mesh)
            train(side, model, opt, sched, x)
        gc.collect()
        gc.freeze()  # what exists now is never garbage: the collection before each timed call stays short
        phases["trained"] = time.perf_counter()

        save_s: dict[str, list[float]] = {s: [] for s in SIDES}
        load_s: dict[str, list[float]] = {s: [] for s in SIDES}
        written: dict[str, Any] = {}
        mismatches: dict[str, list[str]] = {s: [] for s in SIDES}
        for r in range(args.warmup + args.reps):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            paths = {s: root / f"{s}_{r}" for s in SIDES}
            for side in order:
                dt = timed(lambda: save(side, paths[side], *trained[side]))
                if r >= args.warmup:
                    save_s[side].append(dt)
            dist.barrier()
            for side in SIDES:
                written[side] = files_written(paths[side], rank)
            for side in order:
                fresh = build(side, base, mesh)
                dt = timed(lambda f=fresh: load(side, paths[side], *f))
                if r >= args.warmup:
                    load_s[side].append(dt)
                mismatches[side] += [f"repetition {r}: {d}" for d in differences(trained[side][:2], fresh[:2])]
            remove(list(paths.values()))
        phases["saved_and_loaded"] = time.perf_counter()

        staged_s: dict[str, list[float]] = {s: [] for s in SIDES}
        total_s: dict[str, list[float]] = {s: [] for s in SIDES}
        async_complete: dict[str, bool] = {s: True for s in SIDES}
        for r in range(args.warmup + args.reps):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            paths = {s: root / f"{s}_async_{r}" for s in SIDES}
            for side in order:
                t0 = start()
                handle = save(side, paths[side], *trained[side], async_group=async_group)
                t1 = time.perf_counter()
                wait(side, handle)
                t2 = time.perf_counter()
                if r >= args.warmup:
                    staged_s[side].append(t1 - t0)
                    total_s[side].append(t2 - t0)
            dist.barrier()  # rank 0 commits ours when its own upload is done, maybe after rank 1's wait() returned
            for side in SIDES:
                async_complete[side] &= all((paths[side] / f).is_file() for f in SHARED_FILES[side])
            remove(list(paths.values()))
        phases["async_saved"] = time.perf_counter()

        ours_model, ours_opt, _ = trained["ours"]
        state_local = sum(local_bytes([v]) for s in ours_opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor))
        return {
            "rank": rank, "mallopt": pinned,
            "save": {s: stats(save_s[s]) for s in SIDES}, "load": {s: stats(load_s[s]) for s in SIDES},
            "async_save": {s: {"staged": stats(staged_s[s]), "total": stats(total_s[s])} for s in SIDES},
            "async_complete": async_complete,
            "bytes": written, "roundtrip_mismatches": mismatches,
            "info": {"param_bytes_local": local_bytes(list(ours_model.parameters())),
                     "optim_state_bytes_local": state_local},
            "phase_s": {k: round(t - phases["started"], 3) for k, t in phases.items()},
        }
    finally:
        dist.destroy_process_group()


# -- the whole run --------------------------------------------------------------------------------------------------
def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios ours/dcp per rank: times (bench_core's ratio: of the medians, and paired) and bytes."""
    out: dict[str, Any] = {"save": [], "load": [], "async_staged": [], "async_total": [], "rank_bytes": []}
    for r in ranks:
        out["save"].append(ratio(r["save"], "ours", "dcp"))
        out["load"].append(ratio(r["load"], "ours", "dcp"))
        for phase in ("staged", "total"):
            out[f"async_{phase}"].append(ratio({s: r["async_save"][s][phase] for s in SIDES}, "ours", "dcp"))
        out["rank_bytes"].append(r["bytes"]["ours"]["rank_bytes"] / r["bytes"]["dcp"]["rank_bytes"])
    total = {s: sum(r["bytes"][s]["rank_bytes"] for r in ranks) + sum(ranks[0]["bytes"][s]["shared_bytes"].values())
             for s in SIDES}
    out["total_bytes"] = total["ours"] / total["dcp"]
    return {"ratios": out, "total_bytes": total}


def _ms(t: dict[str, Any]) -> str:
    return f"{t['median_s'] * 1e3:.1f} ({t['p25_s'] * 1e3:.1f}-{t['p75_s'] * 1e3:.1f})"


def print_report(res: dict[str, Any]) -> None:
    m, ranks, rat = res["model"], res["per_rank"], res["summary"]["ratios"]
    print(f"\n=== {m['desc']}: {m['n_tensors']} tensors, {m['n_params'] / 1e6:.2f} M params, "
          f"{_mib(m['param_bytes'])} MiB fp32; per rank "
          + ", ".join(f"{_mib(r['info']['param_bytes_local'])} MiB shards + {_mib(r['info']['optim_state_bytes_local'])}"
                      " MiB AdamW state" for r in ranks))
    print("    times in ms: median (p25-p75) over repetitions, from a barrier to the call's return")
    print(f"    {'':<16}{'rank':>5}{'ours':>24}{'dcp':>24}{'ours/dcp':>10}{'paired (p25-p75)':>24}")
    rows = (("save", lambda r, s: r["save"][s], "save"), ("load", lambda r, s: r["load"][s], "load"),
            ("async: returns", lambda r, s: r["async_save"][s]["staged"], "async_staged"),
            ("async: done", lambda r, s: r["async_save"][s]["total"], "async_total"))
    for label, get, key in rows:
        for k, r in enumerate(ranks):
            q = rat[key][k]
            paired = f"{q['paired_median']:.3f} ({q['paired_p25']:.3f}-{q['paired_p75']:.3f})"
            print(f"    {label if k == 0 else '':<16}{k:>5}{_ms(get(r, 'ours')):>24}{_ms(get(r, 'dcp')):>24}"
                  f"{q['of_medians']:10.3f}{paired:>24}")
    print(f"    {'bytes written':<16}{'rank':>5}{'ours MiB (files)':>24}{'dcp MiB (files)':>24}{'ours/dcp':>10}")
    for k, r in enumerate(ranks):
        cells = [f"{_mib(r['bytes'][s]['rank_bytes'])} ({r['bytes'][s]['rank_files']})" for s in SIDES]
        print(f"    {'':<16}{k:>5}{cells[0]:>24}{cells[1]:>24}{rat['rank_bytes'][k]:10.3f}")
    for s in SIDES:
        shared = ranks[0]["bytes"][s]["shared_bytes"]
        print(f"    {s} files for all ranks (rank 0): " + ", ".join(f"{n} {b} B" for n, b in sorted(shared.items())))
    tb = res["summary"]["total_bytes"]
    print(f"    checkpoint total: ours {_mib(tb['ours'])} MiB, dcp {_mib(tb['dcp'])} MiB, ours/dcp "
          f"{rat['total_bytes']:.4f}")
    bad = {s: [d for r in ranks for d in r["roundtrip_mismatches"][s]] for s in SIDES}
    for s in SIDES:
        print(f"    {s}: loads equal the saved state bitwise on every rank: "
              + ("yes" if not bad[s] else f"NO ({len(bad[s])}: {'; '.join(bad[s][:3])})")
              + f"; async saves complete: {'yes' if all(r['async_complete'][s] for r in ranks) else 'NO'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repetitions (a smoke run of seconds)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT})")
    p.add_argument("--dir", default=None,
                   help="where the checkpoint folders are written (default: a temporary folder, in $TMPDIR)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (default 1)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 9; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repetitions first (default 1; quick 0)")
    p.add_argument("--batch", type=int, default=8, help="input rows per rank and training step (default 8)")
    p.add_argument("--width", type=int, default=None, help="many_small width (default 1024; quick 64)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks (default 10; quick 2)")
    p.add_argument("--malloc", choices=("pinned", "glibc"), default="pinned",
                   help="as bench_core (each rank pins its own allocator); default pinned")
    a = p.parse_args(argv)
    a.reps = a.reps or (2 if a.quick else 9)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.quick else 1)
    a.width = a.width or (64 if a.quick else 1024)
    a.depth = a.depth or (2 if a.quick else 10)
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not dist.is_available():
        raise SystemExit("this torch build has no torch.distributed")
    run = SpawnRun(args)
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        given = args.dir is not None
        args.dir = args.dir or os.path.join(tmp, "checkpoints")
        os.makedirs(args.dir, exist_ok=True)
        print(f"bench_checkpoint ({'quick' if args.quick else 'full'}): torch {torch.__version__}, {WORLD} gloo ranks "
              f"x {args.threads} thread(s), FSDP2, AdamW(fused), {args.warmup} warm-up + {args.reps} timed "
              f"repetitions (sides alternating), checkpoints in {args.dir}", flush=True)
        ranks = spawn_ranks(args, tmp, None, run=run_rank)
        if not given:
            args.dir = None

    torch.manual_seed(0)
    params = list(blocked_many_small(args.width, args.depth).parameters())
    results: dict[str, Any] = {
        "benchmark": "bench_checkpoint",
        "mode": "quick" if args.quick else "full",
        "config": {
            "world_size": WORLD, "backend": "gloo", "threads_per_rank": args.threads, "reps": args.reps,
            "warmup": args.warmup, "batch_per_rank": args.batch, "train_steps": STEP, "lr": LR,
            "weight_decay": WEIGHT_DECAY, "optimizer": {"ours": "InBackwardOptimizer(AdamW, fused=True)",
                                                        "dcp": "AdamW(fused=True)"},
            "scheduler": "CosineAnnealingLR(T_max=100) (saved by ours only)", "checkpoint_dir": args.dir or "tmp",
            "malloc": args.malloc, "mallopt_per_rank": [r["mallopt"] for r in ranks],
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "model": {
            "desc": f"{args.depth}x(Linear {args.width}x{args.width} + LayerNorm {args.width} + GELU) + Linear "
                    f"{args.width}x{args.width}, fully_shard per block + root",
            "width": args.width, "depth": args.depth, "n_tensors": len(params),
            "n_params": sum(p.numel() for p in params), "param_bytes": local_bytes(params),
        },
        "per_rank": ranks,
        "summary": summarize(ranks),
    }
    print_report(results)
    run.finish(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

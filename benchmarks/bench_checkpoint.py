"""Two ranks, FSDP2: dist_optim.checkpoint save, load and async save against torch.distributed.checkpoint (DCP).

    python -m benchmarks.bench_checkpoint [--dir /disk/to/measure]   # about a minute on 2 cores
    python -m benchmarks.bench_checkpoint --quick                      # seconds

Every rank builds many_small (default 10 x 1024: 32 tensors, 44 MiB of fp32 parameters), ``fully_shard`` per
block and root, and trains it two steps so that AdamW's state exists. ours: ``InBackwardOptimizer(model, AdamW)``
and a CosineAnnealingLR through ``dist_optim.checkpoint.save``/``load``; dcp: ``torch.optim.AdamW`` the torch way,
``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``. Both write through DCP's FileSystemWriter
with its defaults; ours adds the scheduler, RNG states, dist_optim.json and the COMMITTED marker. Per rank, after
--warmup untimed repetitions, --repeats repetitions (the sides' order alternating) time each call from a barrier to
its return, each load into a fresh model checked bitwise against what was saved; then the bytes each rank wrote,
and async saves (on a gloo group of their own): the time until the call returns and until the save is done.
"""

from __future__ import annotations

import copy
import gc
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from benchmarks import harness as h
from dist_optim import checkpoint

SIDES = ("ours", "dcp")
STEPS = 2  # training steps before the checkpoint
SHARED_FILES = {"ours": (".metadata", "dist_optim.json", "COMMITTED"), "dcp": (".metadata",)}


def build(side: str, base: nn.Module, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh sharded copy of ``base``, its optimizer (in backward for ours) and scheduler."""
    model = h.fully_shard_blocks(copy.deepcopy(base), mesh)
    opt = h.in_backward(model, fused=True) if side == "ours" else h.adamw(model.parameters())
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save(side: str, path: Path, model: nn.Module, opt: Any, sched: Any, group: Any = None) -> Any:
    """Save; with ``group``, asynchronously over that group, returning what to wait on."""
    if side == "ours":
        return checkpoint.save(path, model=model, optimizer=opt, schedulers=sched, step=STEPS,
                               async_save=group is not None, process_group=group)
    if group is not None:
        return dcp.async_save(dcp_state(model, opt), checkpoint_id=path, process_group=group)
    return dcp.save(dcp_state(model, opt), checkpoint_id=path)


def wait(side: str, handle: Any) -> None:
    if side == "ours":
        handle.wait()
    else:  # a Future, or an AsyncSaveResponse where a stager staged asynchronously
        getattr(handle, "upload_completion", handle).result()


def load(side: str, path: Path, model: nn.Module, opt: Any, sched: Any) -> None:
    if side == "ours":
        checkpoint.load(path, model=model, optimizer=opt, schedulers=sched)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def barrier_clock() -> float:
    gc.collect()
    dist.barrier()
    return time.perf_counter()


def files_written(folder: Path, rank: int) -> dict[str, Any]:
    """This rank's data files (DCP names them ``__<rank>_<n>.distcp``) and the files written for all ranks."""
    mine = [f.stat().st_size for f in folder.iterdir() if re.match(rf"__{rank}_\d+\.distcp$", f.name)]
    return {"rank_files": len(mine), "rank_bytes": sum(mine),
            "shared_bytes": {f.name: f.stat().st_size for f in folder.iterdir() if not f.name.endswith(".distcp")}}


def run_rank(rank: int, args: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    device = h.device_of(args, rank)
    mesh = init_device_mesh(device.type, (args.world,))
    async_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    base = h.many_small(args.width, args.depth).to(device)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    trained = {s: build(s, base, mesh) for s in SIDES}
    for side, (model, opt, sched) in trained.items():
        for _ in range(STEPS):
            model(x).square().mean().backward()
            if side == "dcp":
                opt.step()
                opt.zero_grad(set_to_none=True)
            sched.step()
    gc.freeze()  # what exists now is never garbage: the collection before each timed call stays short
    times: dict[str, dict[str, list[float]]] = {k: {s: [] for s in SIDES} for k in ("save", "load", "staged", "done")}
    mismatches: dict[str, list[str]] = {s: [] for s in SIDES}
    written, complete = {}, {s: True for s in SIDES}
    for r in range(args.warmup + args.repeats):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        paths = {s: Path(args.dir) / f"{s}_{r}" for s in SIDES}
        async_paths = {s: Path(args.dir) / f"{s}_{r}_async" for s in SIDES}

        def keep(kind: str, side: str, seconds: float) -> None:
            if r >= args.warmup:
                times[kind][side].append(seconds)

        for side in order:
            t0 = barrier_clock()
            save(side, paths[side], *trained[side])
            keep("save", side, time.perf_counter() - t0)
        dist.barrier()
        written = {s: files_written(paths[s], rank) for s in SIDES}
        for side in order:
            fresh = build(side, base, mesh)
            t0 = barrier_clock()
            load(side, paths[side], *fresh)
            keep("load", side, time.perf_counter() - t0)
            a = h.agreement(list(trained[side][0].parameters()), trained[side][1], list(fresh[0].parameters()),
                            fresh[1])
            lr_equal = [g["lr"] for g in trained[side][1].param_groups] == [g["lr"] for g in fresh[1].param_groups]
            if not (a["params_bitwise_equal"] and a["state_bitwise_equal"] and lr_equal):
                mismatches[side].append(f"repetition {r}: {a}, lr equal {lr_equal}")
        for side in order:  # async, into other folders
            t0 = barrier_clock()
            handle = save(side, async_paths[side], *trained[side], async_group)
            t1 = time.perf_counter()
            wait(side, handle)
            keep("staged", side, t1 - t0)
            keep("done", side, time.perf_counter() - t0)
        dist.barrier()  # rank 0 commits ours when its own upload is done, maybe after rank 1's wait() returned
        for side in SIDES:
            complete[side] &= all((async_paths[side] / f).is_file() for f in SHARED_FILES[side])
        dist.barrier()
        if rank == 0:
            for folder in (*paths.values(), *async_paths.values()):
                shutil.rmtree(folder)
        dist.barrier()
    stats = {k: {s: h.quartiles(v[s]) for s in SIDES} for k, v in times.items()}
    model, opt, _ = trained["ours"]
    return {"times": stats, "ratios": {k: h.ratio(v, "ours", "dcp") for k, v in stats.items()},
            "bytes": written, "roundtrip_mismatches": mismatches, "async_complete": complete,
            "param_bytes_local": h.nbytes(model.parameters()),
            "optim_state_bytes_local": h.nbytes(t for s in opt.state.values() for t in s.values()
                                                if isinstance(t, torch.Tensor))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_checkpoint", __doc__)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    p.add_argument("--width", type=int, default=None, help="many_small width (default 1024; quick 64)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks (default 10; quick 2)")
    common = {"threads": 1, "world": 2, "iters": 1}
    args = h.parse(p, argv, quick={**common, "repeats": 2, "warmup": 0, "width": 64, "depth": 2},
                   full={**common, "repeats": 9, "warmup": 1, "width": 1024, "depth": 10})
    run = h.Run("bench_checkpoint", args)
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        given = args.dir
        args.dir = given or tmp
        ranks, _ = h.spawn(run_rank, args, args.world)
        args.dir = given
    for r in ranks:
        print(f"\n=== rank {r['rank']}: {h.mib(r['param_bytes_local'])} MiB of parameter shards, "
              f"{h.mib(r['optim_state_bytes_local'])} MiB of AdamW state; ms: median (p25-p75)")
        for k, q in r["ratios"].items():
            cells = "".join(f"{s} {t['median_s'] * 1e3:8.1f} ({t['p25_s'] * 1e3:.1f}-{t['p75_s'] * 1e3:.1f})  "
                            for s, t in r["times"][k].items())
            print(f"    {k:<8}{cells}ours/dcp {q['paired_median']:.3f} paired, {q['of_medians']:.3f} of medians")
        b = r["bytes"]
        print(f"    bytes written by the rank: ours {b['ours']['rank_bytes']}, dcp {b['dcp']['rank_bytes']}; loads "
              f"equal the saved state: {not any(r['roundtrip_mismatches'].values())}; async saves complete: "
              f"{all(r['async_complete'].values())}")
    total = {s: sum(r["bytes"][s]["rank_bytes"] for r in ranks) + sum(ranks[0]["bytes"][s]["shared_bytes"].values())
             for s in SIDES}
    print(f"\ncheckpoint total: ours {h.mib(total['ours'])} MiB, dcp {h.mib(total['dcp'])} MiB, "
          f"ours/dcp {total['ours'] / total['dcp']:.4f}")
    return run.finish({"per_rank": ranks, "total_bytes": total})


if __name__ == "__main__":
    main()

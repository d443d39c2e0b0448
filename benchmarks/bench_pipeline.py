"""Two pipeline stages on two ranks: in-backward AdamW against the standard loop on the same schedule (gloo on CPU;
NCCL with CUDA).

    python -m benchmarks.bench_pipeline            # about a minute on 2 cores; spawns its ranks itself
    python -m benchmarks.bench_pipeline --quick    # seconds
    python -m benchmarks.bench_pipeline --dp 2     # pipeline x FSDP2: each stage fully_shard-ed over 2 ranks (4)

Every rank builds the same many_small (default 16 x 512 and its final Linear) and keeps its half as one
``PipelineStage`` (rank 0: the first 8 blocks; rank 1: the other 8 and the final Linear); a unit is one
``schedule.step`` of ``--microbatches`` micro-batches of ``--batch`` rows (MSE loss). Variants per schedule (GPipe,
1F1B), AdamW(fused=True): ``{schedule}_std`` (``schedule.step(); opt.step(); opt.zero_grad()``) and
``{schedule}_inb`` (``dist_optim.pipeline_optimizers(schedule, AdamW)``), which must end bitwise equal to it on
every rank. With ``--dp D`` each stage's blocks and module are ``fully_shard``-ed over D ranks (``2 * D`` ranks,
stage-major, as ``init_device_mesh`` lays them out), and gradient bytes are the rank's shards. Per rank: the
peak (heap_shim.c's tensor bytes of every thread where it builds, else the profiler's), the paired step-time
ratio, the stage's gradient bytes and its largest bucket: the saving one could hope for is the gradient bytes
minus one bucket, the saving measured is the difference of the peaks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import dist_optim
from benchmarks import harness as h

SCHEDULES = ("gpipe", "1f1b")


def stage_module(base: nn.Sequential, rank: int, world: int) -> nn.Sequential:
    """This rank's contiguous share of ``base``'s blocks (the last rank also takes the final Linear)."""
    blocks = list(base)[:-1]
    per = len(blocks) // world
    mine = blocks[rank * per:(rank + 1) * per] + ([list(base)[-1]] if rank == world - 1 else [])
    return copy.deepcopy(nn.Sequential(*mine))


def variant(name: str, base: nn.Sequential, batch: tuple[torch.Tensor, torch.Tensor], rank: int,
            args: Any) -> h.Variant:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    schedule, loop = name.rsplit("_", 1)
    device = batch[0].device
    stages = args.world // args.dp
    pp_rank, group = rank // args.dp, None
    module = stage_module(base, pp_rank, stages).to(device)
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (stages, args.dp), mesh_dim_names=("pp", "dp"))
        for block in module:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        group = mesh["pp"].get_group()
    stage = PipelineStage(module, pp_rank, stages, device, group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    first, last = pp_rank == 0, pp_rank == stages - 1
    params = list(module.parameters())

    def run() -> None:
        x, y = batch
        sched.step(*((x,) if first else ()), **({"target": y} if last else {}))

    if loop == "std":
        return h.standard(run, params, h.adamw(params))
    (opt,) = dist_optim.pipeline_optimizers(sched, torch.optim.AdamW, lr=h.LR, weight_decay=h.WEIGHT_DECAY,
                                            fused=True, bucket_cap_mb=args.bucket_cap_mb)
    return h.Variant([run], params, opt, f"{schedule}_std")


def run_rank(rank: int, args: Any) -> dict[str, Any]:
    device = h.device_of(args, rank)
    torch.manual_seed(0)
    base = h.many_small(args.width, args.depth)  # the same on every rank; each keeps its stage
    g = torch.Generator().manual_seed(100)  # the same batch on every rank: the first stage reads x, the last y
    rows = args.batch * args.microbatches
    batch = (torch.randn(rows, args.width, generator=g).to(device), torch.randn(rows, args.width, generator=g).to(device))
    variants = {f"{s}_{loop}": variant(f"{s}_{loop}", base, batch, rank, args) for s in SCHEDULES
                for loop in ("std", "inb")}
    pairs = [(n, v.reference) for n, v in variants.items() if v.reference]
    res = h.measure(variants, args, pairs, device, args.memory_iters)
    res["grad_bytes"] = h.nbytes(variants["1f1b_std"].params)
    res["bucket_bytes"] = {n: h.bucket_bytes(variants[n].opt) for n, _ in pairs}
    return res


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per schedule and rank (stage): the paired time ratio, both peaks, the saving measured and the one hoped for,
    and the agreement."""
    out = {}
    for n, ref in ((n, v["reference"]) for n, v in ranks[0]["variants"].items() if v["reference"]):
        peaks = [(r["variants"][ref]["memory"]["peak_bytes"], r["variants"][n]["memory"]["peak_bytes"]) for r in ranks]
        out[f"{n}/{ref}"] = {
            "time_ratio_paired": [r["ratios"][f"{n}/{ref}"]["paired_median"] for r in ranks],
            "peak_bytes": peaks, "peak_ratio": [b / a for a, b in peaks],
            "saved_bytes": [a - b for a, b in peaks],
            "grad_bytes": [r["grad_bytes"] for r in ranks],
            "hoped_saving_bytes": [r["grad_bytes"] - max(r["bucket_bytes"][n]) for r in ranks],
            "params_bitwise_equal": all(r["variants"][n]["agreement"]["params_bitwise_equal"] for r in ranks),
            "state_bitwise_equal": all(r["variants"][n]["agreement"]["state_bitwise_equal"] for r in ranks),
            "max_abs_diff": max(r["variants"][n]["agreement"]["max_abs_diff"] for r in ranks),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_pipeline", __doc__)
    p.add_argument("--width", type=int, default=None, help="many_small width (default 512; quick 64)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks, split over the stages (default 16)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per schedule step (default 4)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the engine's bucket cap (default 1)")
    h.add_rank_memory_options(p)
    p.add_argument("--dp", type=int, default=1, help="fully_shard each stage over this many ranks (default 1: none)")
    common = {"threads": 1, "microbatches": 4}
    args = h.parse(p, argv, quick={**common, "repeats": 2, "iters": 1, "warmup": 2, "width": 64, "depth": 4,
                                   "bucket_cap_mb": 0.01},
                   full={**common, "repeats": 15, "iters": 2, "warmup": 3, "width": 512, "depth": 16,
                         "bucket_cap_mb": 1.0})
    if args.dp < 1:
        p.error(f"--dp must be >= 1, got {args.dp}")
    args.world = 2 * args.dp  # two stages
    if args.depth % 2:
        p.error(f"--depth must be a multiple of the 2 stages, got {args.depth}")
    run = h.Run("bench_pipeline", args)
    ranks, no_shim = h.spawn_ranks(run_rank, args)
    summary = summarize(ranks)
    for r in ranks:
        peak = "the profiler" if no_shim else "tensor bytes of every thread"
        print(f"\n=== rank {r['rank']} (stage {r['rank'] // args.dp}): peak = {peak}, gradients "
              f"{h.mib(r['grad_bytes'])} MiB")
        h.print_table(r)
    print("\n=== per stage: in backward / standard on the same schedule   time (paired)  peak MiB       "
          "saved / hoped MiB")
    for key, s in summary.items():
        for k in range(len(ranks)):
            print(f"    {key if k == 0 else '':<40}{k:>5}{s['time_ratio_paired'][k]:14.3f}"
                  f"{h.mib(s['peak_bytes'][k][0]):>8} ->{h.mib(s['peak_bytes'][k][1]):>6}"
                  f"{h.mib(s['saved_bytes'][k]):>9} /{h.mib(s['hoped_saving_bytes'][k]):>6}"
                  f"   bitwise {s['params_bitwise_equal'] and s['state_bitwise_equal']}")
    return run.finish({"all_thread_memory": no_shim is None, "per_rank": ranks, "summary": summary})


if __name__ == "__main__":
    main()

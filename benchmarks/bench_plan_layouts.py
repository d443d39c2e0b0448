"""The memory planner's layouts against measurement: one rank of a DDP or FSDP2 job planned on fake tensors, the
same job run for real on 2 gloo ranks.

    python -m benchmarks.bench_plan_layouts            # the trainer's GPT, DDP's options, FSDP2: many minutes
    python -m benchmarks.bench_plan_layouts --quick    # one DDP and one FSDP2 configuration

The planner plans one representative rank (``dist_optim.plan(..., world_size=2, parallel="ddp")``, or
``"fsdp2"``). The measurement runs the planner's own ``Job`` on a real ``DistributedDataParallel`` model (or one
``fully_shard``-ed per block, then the root) on each of 2 spawned gloo ranks (each its own micro-batch), two warm-up
steps (DDP rebuilds its buckets at the second), then measures a step
with ``heap_shim.c`` preloaded: the tensor bytes of every thread (gloo's work threads too), their peak above the
step's start (the median of 5 steps; the lowest, for FSDP2, in ``compare(statistic="min")``) and the live bytes
at the start above those before the model was built. Each loop
runs in its own group of ranks (a loop's model freed late would move the next one's baseline). The profiler's
peak of the same step (the calling thread only) is recorded beside it: the difference is what gloo's threads
allocate as tensors, which the plan cannot see.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from benchmarks import harness as h
from benchmarks.bench_plan import OPTIMIZER_KWARGS, _builders
from dist_optim import plan
from dist_optim._plan import LOOPS, Job
from dist_optim._plan_fsdp2 import shard

WORLD = 2
WARMUP = 2  # DDP's first iteration buckets everything at once and rebuilds its buckets at the second forward
STEPS = 5  # steps measured per rank: gloo's per-rank peak under FSDP2 moves from step to step (see compare)
SHAPE = (2, 4, 256, 32, 4)  # n_layer, n_head, n_embd, block_size, batch: 1.7 M parameters, 6.6 MiB of gradients
LARGER = (4, 8, 512, 32, 4)  # 12.9 M parameters: FSDP2's gradients above its activations, a saving to measure
FSDP2 = {"parallel": "fsdp2"}
# (label, shape, layout options, engine options)
CONFIGS = [
    ("ddp, cap 0.5", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {}),
    ("ddp, cap 0.5, views", SHAPE, {"ddp_bucket_cap_mb": 0.5, "gradient_as_bucket_view": True}, {}),
    ("ddp, default cap", SHAPE, {}, {}),
    ("ddp, cap 0.5, exact", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {"max_grad_norm": 0.05, "clip_mode": "exact"}),
    ("ddp, cap 0.5, two_pass", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {"max_grad_norm": 0.05, "clip_mode": "two_pass"}),
    ("fsdp2, 2 x 256, cap 0.5", SHAPE, FSDP2, {"bucket_cap_mb": 0.5}),
    ("fsdp2, 4 x 512, cap 0.5", LARGER, FSDP2, {"bucket_cap_mb": 0.5}),
    ("fsdp2, 4 x 512, exact", LARGER, FSDP2, {"bucket_cap_mb": 0.5, "max_grad_norm": 0.05, "clip_mode": "exact"}),
]


def _rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One loop's warm step on this rank: live bytes at its start, its peak above the start (all threads; the
    profiler's too)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    shim = h.HeapShim.required()
    model_fn, batch_fn, loss = _builders(tuple(args.shape))
    gc.collect()
    base = shim.lib.shim_current()
    torch.manual_seed(0)
    layout = dict(args.layout)
    if layout.get("parallel", "ddp") == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        model = shard(model_fn(), init_device_mesh("cpu", (WORLD,)), None)  # the blocks, then the root
    else:
        model = DDP(model_fn(), bucket_cap_mb=layout.get("ddp_bucket_cap_mb"),
                    gradient_as_bucket_view=layout.get("gradient_as_bucket_view", False))
    job = Job(model, args.loop, loss, torch.optim.AdamW, OPTIMIZER_KWARGS, dict(args.engine))
    torch.manual_seed(100 + rank)  # each rank its own micro-batches
    for _ in range(WARMUP):
        job.step([batch_fn()])
    batches = [batch_fn()]
    return shim.warm_step(lambda: job.step(batches), base, STEPS)


def measured(shape: tuple[int, ...], layout: dict[str, Any], engine: dict[str, Any]) -> dict[str, list[dict]]:
    """Per loop, each rank's measured figures (each loop in its own spawned group of ``WORLD`` gloo ranks)."""
    out = {}
    for loop in LOOPS:
        args = argparse.Namespace(device="cpu", threads=1, malloc="pinned", shape=list(shape), loop=loop,
                                  layout=sorted(layout.items()), engine=sorted(engine.items()))
        ranks, no_shim = h.spawn(_rank, args, WORLD, heap_shim=True)
        if no_shim:
            raise RuntimeError(f"heap shim not preloaded ({no_shim}): no per-rank peak of every thread")
        out[loop] = ranks
    return out


def compare(shape: tuple[int, ...], layout: dict[str, Any], engine: dict[str, Any], statistic: str = "median"
            ) -> dict[str, Any]:
    """Planned (one rank) against measured (every rank); ``error`` is (planned - measured) / measured on the rank
    furthest from the plan. Each rank's step peak is the ``statistic`` (``"median"`` or ``"min"``) of its STEPS
    steps: under DDP they are all equal; under FSDP2 on gloo some steps' peaks are higher (by what gloo's
    collectives allocate, when it lands on the peak), and the plan, whose collectives allocate nothing, is the floor:
    ``"min"`` is that floor measured."""
    pick = {"median": lambda xs: sorted(xs)[(len(xs) - 1) // 2], "min": min}[statistic]
    model_fn, batch_fn, loss = _builders(shape)
    p = plan(model_fn, batch_fn, loss, torch.optim.AdamW, world_size=WORLD, **{"parallel": "ddp", **layout}, **engine,
             **OPTIMIZER_KWARGS)
    m = measured(shape, layout, engine)
    for ranks in m.values():
        for r in ranks:
            r["step_peak_bytes"] = pick(r["step_peak_each"])
    res: dict[str, Any] = {"layout": layout, "engine": engine, "statistic": statistic}
    peaks: dict[str, list[int]] = {}
    for lp in p.loops():
        ranks = m[lp.loop]
        peaks[lp.loop] = [r["start_bytes"] + r["step_peak_bytes"] for r in ranks]
        worst = max(range(WORLD), key=lambda k: abs(lp.peak_bytes / peaks[lp.loop][k] - 1))
        r = ranks[worst]
        res[lp.loop] = {
            "planned_peak": lp.peak_bytes, "measured_peak": peaks[lp.loop][worst],
            "planned_start": lp.start_bytes, "measured_start": r["start_bytes"],
            "planned_step_peak": lp.step_peak_bytes, "measured_step_peak": r["step_peak_bytes"],
            "error": lp.peak_bytes / peaks[lp.loop][worst] - 1,
            "step_error": lp.step_peak_bytes / max(1, r["step_peak_bytes"]) - 1,
            "gloo_threads_bytes": [x["step_peak_bytes"] - x["profiler_step_peak_bytes"] for x in ranks],
            "breakdown": lp.breakdown, "ranks": ranks,
        }
    saving_m = [s - i for s, i in zip(peaks["standard"], peaks["in_backward"])]
    res["saving"] = {"planned": p.saving_bytes, "measured": saving_m,
                     "error": [(p.saving_bytes - s) / s if s else None for s in saving_m]}
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_plan_layouts", __doc__)
    args = h.parse(p, argv, quick={"threads": 1}, full={"threads": 1})
    run = h.Run("bench_plan_layouts", args)
    configs = [CONFIGS[0], CONFIGS[5]] if args.quick else CONFIGS
    rows = {}
    print(f"{'configuration':<26} {'loop':<12} {'planned':>9} {'measured':>9} {'err':>7}  {'step planned':>12} "
          f"{'measured':>9}  gloo threads   saving planned / measured MiB")
    for label, shape, layout, engine in configs:
        r = rows[label] = compare(shape, layout, engine)
        s = r["saving"]
        for loop in LOOPS:
            x = r[loop]
            tail = (f"   {h.mib(s['planned'])} / {' '.join(h.mib(v) for v in s['measured'])}"
                    if loop == "standard" else "")
            print(f"{label:<26} {loop:<12} {h.mib(x['planned_peak']):>9} {h.mib(x['measured_peak']):>9} "
                  f"{100 * x['error']:>+6.2f}%  {h.mib(x['planned_step_peak']):>12} "
                  f"{h.mib(x['measured_step_peak']):>9}"
                  f"  {max(x['gloo_threads_bytes']):>12}{tail}")
    return run.finish({"world": WORLD, "rows": rows})


if __name__ == "__main__":
    main()

"""The memory planner's layouts against measurement: one rank of a DDP, FSDP2, tensor-parallel, FSDP2 x TP or HSDP
job planned on fake tensors, the same job run for real on 2 or 4 gloo ranks.

    python -m benchmarks.bench_plan_layouts                      # every layout: many minutes
    python -m benchmarks.bench_plan_layouts --quick              # one DDP and one FSDP2 configuration
    python -m benchmarks.bench_plan_layouts --layouts tp hsdp    # the rows of these layouts only

The planner plans one representative rank (``dist_optim.plan(..., world_size=2, parallel="ddp")``, or
``"fsdp2"``, ``"tp"`` on 2 ranks, ``"fsdp2+tp"`` and ``"hsdp"`` on 2 x 2). The measurement runs the planner's own
``Job`` on a real ``DistributedDataParallel`` model (or one ``fully_shard``-ed per block, then the root; or the
trainer's tensor-parallel GPT, ``launch.tensor_parallel.tensor_parallel``, laid out by the planner's own
``_plan_tp.wrap`` on a real mesh) on each of 2 or 4 spawned gloo ranks (each data-parallel replica its own
micro-batch, the TP ranks of a replica the same), two warm-up steps (DDP rebuilds its buckets at the second), then
measures a step
with ``heap_shim.c`` preloaded: the tensor bytes of every thread (gloo's work threads too), their peak above the
step's start (the mode of 15 steps: gloo frees some buffers late, on its own thread, in a few of them) and the live
bytes at the start above those before the model was built (the mode of the steps' starts). Each loop
runs in its own group of ranks (a loop's model freed late would move the next one's baseline). The profiler's
peak of the same step (the calling thread only) is recorded beside it: the difference is what gloo's threads
allocate as tensors, which the plan cannot see.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks import harness as h
from benchmarks.bench_plan import OPTIMIZER_KWARGS, _builders
from dist_optim import plan
from dist_optim._planner._fsdp2 import shard
from dist_optim._planner._step import LOOPS, Job
from dist_optim._planner._tp import mesh_shape, wrap
from launch.gpt import loss_fn
from launch.tensor_parallel import tensor_parallel

WORLD = 2
WARMUP = 2  # DDP's first iteration buckets everything at once and rebuilds its buckets at the second forward
STEPS = 15  # steps measured per rank: gloo's per-rank peak under FSDP2 moves from step to step (see compare)
SHAPE = (2, 4, 256, 32, 4)  # n_layer, n_head, n_embd, block_size, batch: 1.7 M parameters, 6.6 MiB of gradients
LARGER = (4, 8, 512, 32, 4)  # 12.9 M parameters: FSDP2's gradients above its activations, a saving to measure
FSDP2 = {"parallel": "fsdp2"}
TP = {"parallel": "tp", "world_size": 2}
FSDP2_TP = {"parallel": "fsdp2+tp", "world_size": 4, "tp_size": 2}
HSDP = {"parallel": "hsdp", "world_size": 4, "shard_size": 2}
# (label, shape, layout options, engine options)
CONFIGS = [
    ("ddp, cap 0.5", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {}),
    ("ddp, cap 0.5, views", SHAPE, {"ddp_bucket_cap_mb": 0.5, "gradient_as_bucket_view": True}, {}),
    ("ddp, default cap", SHAPE, {}, {}),
    ("ddp, cap 0.5, exact", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {"max_grad_norm": 0.05, "clip_mode": "exact"}),
    ("ddp, cap 0.5, two_pass", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {"max_grad_norm": 0.05, "clip_mode": "two_pass"}),
    ("ddp, cap 0.5, accumulation 2", SHAPE, {"ddp_bucket_cap_mb": 0.5}, {"accumulation_steps": 2}),
    ("ddp, cap 0.5, views, accumulation 2", SHAPE, {"ddp_bucket_cap_mb": 0.5, "gradient_as_bucket_view": True},
     {"accumulation_steps": 2}),
    ("fsdp2, 2 x 256, cap 0.5", SHAPE, FSDP2, {"bucket_cap_mb": 0.5}),
    ("fsdp2, 4 x 512, cap 0.5", LARGER, FSDP2, {"bucket_cap_mb": 0.5}),
    ("fsdp2, 4 x 512, exact", LARGER, FSDP2, {"bucket_cap_mb": 0.5, "max_grad_norm": 0.05, "clip_mode": "exact"}),
    ("fsdp2, 2 x 256, accumulation 2", SHAPE, FSDP2, {"bucket_cap_mb": 0.5, "accumulation_steps": 2}),
    ("fsdp2, 4 x 512, accumulation 2", LARGER, FSDP2, {"bucket_cap_mb": 0.5, "accumulation_steps": 2}),
    ("tp, 2 x 256, cap 0.5", SHAPE, TP, {"bucket_cap_mb": 0.5}),
    ("tp, 4 x 512, cap 0.5", LARGER, TP, {"bucket_cap_mb": 0.5}),
    ("tp, 4 x 512, exact", LARGER, TP, {"bucket_cap_mb": 0.5, "max_grad_norm": 0.05, "clip_mode": "exact"}),
    ("fsdp2+tp, 2 x 256, cap 0.5", SHAPE, FSDP2_TP, {"bucket_cap_mb": 0.5}),
    ("fsdp2+tp, 4 x 512, cap 0.5", LARGER, FSDP2_TP, {"bucket_cap_mb": 0.5}),
    ("fsdp2+tp, 4 x 512, exact", LARGER, FSDP2_TP, {"bucket_cap_mb": 0.5, "max_grad_norm": 0.05,
                                                    "clip_mode": "exact"}),
    ("hsdp, 2 x 256, cap 0.5", SHAPE, HSDP, {"bucket_cap_mb": 0.5}),
    ("hsdp, 4 x 512, cap 0.5", LARGER, HSDP, {"bucket_cap_mb": 0.5}),
]
LAYOUTS = ("ddp", "fsdp2", "tp", "fsdp2+tp", "hsdp")


def _parallel(layout: dict[str, Any]) -> str:
    return layout.get("parallel", "ddp")


def _world(layout: dict[str, Any]) -> int:
    return layout.get("world_size", WORLD)


def _tp_loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The GPT's loss where its logits are a replicated DTensor (``tensor_parallel`` leaves them so)."""
    logits = model(b[0])
    return loss_fn(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, b[1])


def _replica(rank: int, layout: dict[str, Any]) -> int:
    """This rank's data-parallel replica (the TP ranks of one see the same micro-batch)."""
    parallel = _parallel(layout)
    return 0 if parallel == "tp" else rank // layout["tp_size"] if parallel == "fsdp2+tp" else rank


def _rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One loop's warm step on this rank: live bytes at its start, its peak above the start (all threads; the
    profiler's too)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    shim = h.HeapShim.required()
    model_fn, batch_fn, loss = _builders(tuple(args.shape))
    h.freeze_survivors()  # the modules the previous row imported too (DDP's torch._dynamo, ...)
    base = shim.lib.shim_current()
    torch.manual_seed(0)
    layout = dict(args.layout)
    parallel = _parallel(layout)
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        model = shard(model_fn(), init_device_mesh("cpu", (WORLD,)), None)  # the blocks, then the root
    elif parallel in ("tp", "fsdp2+tp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        shape_, names = mesh_shape(parallel, _world(layout), layout.get("tp_size"), layout.get("shard_size"))
        mesh = init_device_mesh("cpu", shape_, mesh_dim_names=names)
        model = wrap(model_fn(), mesh, parallel, tensor_parallel if parallel != "hsdp" else None, None)
        loss = _tp_loss
    else:
        model = DDP(model_fn(), bucket_cap_mb=layout.get("ddp_bucket_cap_mb"),
                    gradient_as_bucket_view=layout.get("gradient_as_bucket_view", False))
    engine = dict(args.engine)
    job = Job(model, args.loop, loss, torch.optim.AdamW, OPTIMIZER_KWARGS, engine)
    torch.manual_seed(100 + _replica(rank, layout))  # each replica its own micro-batches
    micro = engine.get("accumulation_steps", 1)  # under DDP and FSDP2 only the last one reduces (Job)
    for _ in range(WARMUP):
        job.step([batch_fn() for _ in range(micro)])
    batches = [batch_fn() for _ in range(micro)]
    return shim.warm_step(lambda: job.step(batches), base, args.steps)


def measured_together(configs: list[tuple], steps: int = STEPS, loops: tuple[str, ...] = LOOPS
                      ) -> dict[str, dict[str, list[dict]]]:
    """Per configuration (label, shape, layout, engine; one world size), per loop, each rank's measured figures over
    ``steps`` warm steps: one spawned group of gloo ranks measures the configurations, under each of ``loops``, one
    after the other (each from its own baseline, taken after the previous one's model is freed). One group for
    several rows and both loops saves their interpreters (the tests' way); the benchmark gives each row and loop
    its own."""
    worlds = {_world(layout) for _, _, layout, _ in configs}
    if len(worlds) != 1:
        raise ValueError(f"measured_together needs one world size, got {sorted(worlds)}")
    world = worlds.pop()
    rows = [{"shape": list(shape), "layout": sorted(layout.items()), "engine": sorted(engine.items())}
            for _, shape, layout, engine in configs]
    args = argparse.Namespace(device="cpu", threads=1, malloc="pinned", steps=steps)
    each = h.spawn_rows_per_loop(_rank, args, rows, loops, world)
    return {label: m for (label, *_), m in zip(configs, each)}


def measured(shape: tuple[int, ...], layout: dict[str, Any], engine: dict[str, Any], steps: int = STEPS
             ) -> dict[str, list[dict]]:
    """Per loop, each rank's measured figures over ``steps`` warm steps (each loop in its own spawned group of
    ``WORLD`` gloo ranks)."""
    return {loop: measured_together([("", shape, layout, engine)], steps, (loop,))[""][loop] for loop in LOOPS}


def compare(shape: tuple[int, ...], layout: dict[str, Any], engine: dict[str, Any], statistic: str = "mode",
            steps: int = STEPS, m: dict[str, list[dict]] | None = None) -> dict[str, Any]:
    """Planned (one rank) against measured (every rank); ``error`` is (planned - measured) / measured on the rank
    furthest from the plan. Each rank's step peak is the ``statistic`` (``"mode"``, ``"median"`` or ``"min"``) of
    its ``steps`` steps (STEPS in the benchmark; fewer in the tests): under DDP they are all equal; under FSDP2 on gloo most steps measure the same peak, and a few
    are higher (a buffer gloo frees late, on its own thread, after the collective has returned, that lands on the
    peak) or lower: the mode is the step the plan plans, and ``late`` counts the steps above it on each rank
    (``late_max_bytes``: the most above), the headroom the plan states. ``m``: the figures already measured
    (:func:`measured_together`) instead of measuring them here."""
    pick = {"mode": h.mode, "median": lambda xs: sorted(xs)[(len(xs) - 1) // 2], "min": min}[statistic]
    model_fn, batch_fn, loss = _builders(shape)
    parallel, world = _parallel(layout), _world(layout)
    extra: dict[str, Any] = {}
    if parallel in ("tp", "fsdp2+tp"):
        extra, loss = {"parallelize": tensor_parallel}, _tp_loss
    p = plan(model_fn, batch_fn, loss, torch.optim.AdamW, **{"parallel": "ddp", "world_size": WORLD, **layout},
             **extra, **engine, **OPTIMIZER_KWARGS)
    m = measured(shape, layout, engine, steps) if m is None else m
    for ranks in m.values():
        for r in ranks:
            r["step_peak_bytes"] = pick(r["step_peak_each"])
            r["late"] = sum(x > r["step_peak_bytes"] for x in r["step_peak_each"])
            r["late_max_bytes"] = max(r["step_peak_each"]) - r["step_peak_bytes"]
    res: dict[str, Any] = {"layout": layout, "engine": engine, "statistic": statistic}
    peaks: dict[str, list[int]] = {}
    for lp in p.loops():
        ranks = m[lp.loop]
        peaks[lp.loop] = [r["start_bytes"] + r["step_peak_bytes"] for r in ranks]
        worst = max(range(world), key=lambda k: abs(lp.peak_bytes / peaks[lp.loop][k] - 1))
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
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=None,
                   help="measure the rows of these layouts only (default: every layout; --quick: ddp and fsdp2)")
    args = h.parse(p, argv, quick={"threads": 1}, full={"threads": 1})
    run = h.Run("bench_plan_layouts", args)
    quick = ("ddp, cap 0.5", "fsdp2, 2 x 256, cap 0.5")
    configs = [c for c in CONFIGS if c[0] in quick] if args.quick and args.layouts is None else CONFIGS
    if args.layouts is not None:
        configs = [c for c in configs if _parallel(c[2]) in args.layouts]
    rows = {}
    print(f"{'configuration':<26} {'loop':<12} {'planned':>9} {'measured':>9} {'err':>7}  {'step planned':>12} "
          f"{'measured':>9}  gloo threads  late steps (most MiB)   saving planned / measured MiB")
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
                  f"  {max(x['gloo_threads_bytes']):>12}"
                  f"  {sum(k['late'] for k in x['ranks']):>3}/{STEPS * len(x['ranks']):<3} "
                  f"({h.mib(max(k['late_max_bytes'] for k in x['ranks']))}){tail}")
    return run.finish({"world": {label: _world(layout) for label, _, layout, _ in configs}, "rows": rows})


if __name__ == "__main__":
    main()

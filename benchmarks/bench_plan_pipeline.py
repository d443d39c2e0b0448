"""The memory planner's pipeline stages against measurement: every stage rank of a pipeline job planned on fake
tensors, the same job run for real on 2 gloo ranks (2 stages).

    python -m benchmarks.bench_plan_pipeline            # the trainer's GPT, 1F1B and GPipe, two shapes: minutes
    python -m benchmarks.bench_plan_pipeline --quick    # 1F1B and GPipe over one micro-batch, 2 x 256

The planner plans each stage (``dist_optim.plan(..., world_size=2, parallel="pp")``). The measurement runs the
planner's own ``PipelineJob`` on each of 2 spawned gloo ranks: every rank builds the trainer's GPT from the same
seed and keeps its stage (``launch.pipeline.gpt_stage``, the trainer's cut), a ``PipelineStage`` without given
shapes (the schedule infers them at its first step, as in the trainer), the schedule's ``loss_fn`` on the last
stage (``launch.gpt.loss_fn``); each rank makes the same pipeline batch. Two warm-up steps, then a step measured
with ``heap_shim.c`` preloaded: the tensor bytes of every thread (gloo's work threads too), their peak above the
step's start (the median of 5 steps) and the live bytes at the start above those before the model was built. Each
loop runs in its own group of ranks. The profiler's peak of the same step (the calling thread only) is recorded
beside it: the difference is what gloo's threads allocate as tensors, which the plan cannot see (0 on every rank);
on the last stage the profiler also counts the outputs the schedule kept from the step before, freed in this one
but made before it started, so its peak is that much higher there.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from benchmarks import harness as h
from benchmarks.bench_plan import OPTIMIZER_KWARGS, _builders
from dist_optim import plan
from dist_optim._planner._pipeline import PipelineJob, schedule_class
from dist_optim._planner._step import LOOPS
from launch.gpt import loss_fn
from launch.pipeline import gpt_stage

WORLD = 2  # stages, one per rank
WARMUP = 2  # the first step infers the shapes and allocates the receive buffers and the optimizer state
STEPS = 5  # steps measured per rank, the median kept
SHAPE = (2, 4, 256, 32, 4)  # n_layer, n_head, n_embd, block_size, micro-batch rows: 1.7 M parameters
LARGER = (4, 8, 512, 32, 4)  # 12.9 M parameters: the gradients above the activations
# (label, shape, schedule, micro-batches, engine options): the trainer's schedule and micro-batch count (1F1B, 4),
# GPipe, and GPipe over one micro-batch, where nothing accumulates and stepping in backward saves the gradients
CAP = {"bucket_cap_mb": 0.5}
CONFIGS = [
    ("1F1B, 2 x 256", SHAPE, "1F1B", 4, CAP),
    ("GPipe, 2 x 256", SHAPE, "GPipe", 4, CAP),
    ("GPipe, 2 x 256, 1 micro-batch", SHAPE, "GPipe", 1, CAP),
    ("1F1B, 4 x 512", LARGER, "1F1B", 4, CAP),
    ("GPipe, 4 x 512", LARGER, "GPipe", 4, CAP),
    ("GPipe, 4 x 512, 1 micro-batch", LARGER, "GPipe", 1, CAP),
    ("1F1B, 4 x 512, per_parameter", LARGER, "1F1B", 4, {**CAP, "max_grad_norm": 0.05, "clip_mode": "per_parameter"}),
]


def pipeline_batch(batch_fn: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` micro-batches in one pipeline batch, as the planner makes it (the schedule splits it again)."""
    micro = [batch_fn() for _ in range(n)]
    return torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])


def _rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One loop's warm step on this rank's stage: live bytes at its start, its peak above the start (all threads; the
    profiler's too)."""
    from torch.distributed.pipelining import PipelineStage

    shim = h.HeapShim.required()
    model_fn, batch_fn, _ = _builders(tuple(args.shape))
    h.freeze_survivors()  # the modules the previous row imported too (DDP's torch._dynamo, ...)
    base = shim.lib.shim_current()
    torch.manual_seed(0)
    module = gpt_stage(model_fn(), rank, WORLD)  # the whole model built, this stage kept, as the trainer does
    gc.collect()
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
    job = PipelineJob(stage, schedule_class(args.schedule), args.microbatches, loss_fn, args.loop, torch.optim.AdamW,
                      OPTIMIZER_KWARGS, dict(args.engine))
    torch.manual_seed(100)  # the same batch on every rank: the first stage reads its inputs, the last its targets
    for _ in range(WARMUP):
        job.step([pipeline_batch(batch_fn, args.microbatches)])
    batches = [pipeline_batch(batch_fn, args.microbatches)]
    return shim.warm_step(lambda: job.step(batches), base, STEPS)


def measured_together(configs: list[tuple]) -> dict[str, dict[str, list[dict]]]:
    """Per configuration (label, shape, schedule, micro-batches, engine), per loop, each rank's (stage's) measured
    figures: each loop in its own spawned group of ``WORLD`` ranks, which measures the configurations one after the
    other (each from its own baseline). One group for several rows saves each row's interpreters (the tests' way)."""
    rows = [{"shape": list(shape), "schedule": schedule, "microbatches": micro, "engine": sorted(engine.items())}
            for _, shape, schedule, micro, engine in configs]
    out: dict[str, dict[str, list[dict]]] = {label: {} for label, *_ in configs}
    for loop in LOOPS:
        args = argparse.Namespace(device="cpu", threads=1, malloc="pinned", loop=loop)
        each, no_shim = h.spawn_rows(_rank, args, rows, WORLD, heap_shim=True)
        if no_shim:
            raise RuntimeError(f"heap shim not preloaded ({no_shim}): no per-rank peak of every thread")
        for (label, *_), ranks in zip(configs, each):
            out[label][loop] = ranks
    return out


def measured(shape: tuple[int, ...], schedule: str, microbatches: int, engine: dict[str, Any]
             ) -> dict[str, list[dict]]:
    """Per loop, each rank's (stage's) measured figures (each loop in its own spawned group of ``WORLD`` ranks)."""
    return measured_together([("", shape, schedule, microbatches, engine)])[""]


def compare(shape: tuple[int, ...], schedule: str, microbatches: int, engine: dict[str, Any],
            m: dict[str, list[dict]] | None = None) -> dict[str, Any]:
    """Each stage planned against its rank measured; ``error`` is (planned - measured) / measured. ``m``: the
    figures already measured (:func:`measured_together`) instead of measuring them here."""
    model_fn, batch_fn, _ = _builders(shape)
    p = plan(model_fn, batch_fn, loss_fn, torch.optim.AdamW, world_size=WORLD, parallel="pp", pp_schedule=schedule,
             n_microbatches=microbatches, pp_stage_fn=gpt_stage, **engine, **OPTIMIZER_KWARGS)
    m = measured(shape, schedule, microbatches, engine) if m is None else m
    stages = []
    for k, sp in enumerate(p.stages):
        res: dict[str, Any] = {"stage": k, "n_params": sp.n_params, "recv_buffer_bytes": sp.options["recv_buffer_bytes"]}
        peaks = {}
        for lp in sp.loops():
            r = m[lp.loop][k]
            peaks[lp.loop] = r["start_bytes"] + r["step_peak_bytes"]
            res[lp.loop] = {
                "planned_peak": lp.peak_bytes, "measured_peak": peaks[lp.loop],
                "planned_start": lp.start_bytes, "measured_start": r["start_bytes"],
                "planned_step_peak": lp.step_peak_bytes, "measured_step_peak": r["step_peak_bytes"],
                "error": lp.peak_bytes / peaks[lp.loop] - 1,
                "step_error": lp.step_peak_bytes / max(1, r["step_peak_bytes"]) - 1,
                # what other threads (gloo's) allocate as tensors, and on the last stage minus the outputs kept from
                # the step before, freed in this one: the profiler, which started after they were made, cannot
                # subtract them (its warning "Memory block of unknown size was allocated before the profiling")
                "shim_minus_profiler_bytes": r["step_peak_bytes"] - r["profiler_step_peak_bytes"],
                "peak_phase": lp.peak_phase, "breakdown": lp.breakdown, "measured_rank": r,
            }
        saving = peaks["standard"] - peaks["in_backward"]
        res["saving"] = {"planned": sp.saving_bytes, "measured": saving,
                         "error": (sp.saving_bytes - saving) / saving if saving else None}
        stages.append(res)
    return {"schedule": schedule, "microbatches": microbatches, "engine": engine, "largest_stage": p.options["stage"],
            "stages": stages}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_plan_pipeline", __doc__)
    args = h.parse(p, argv, quick={"threads": 1}, full={"threads": 1})
    run = h.Run("bench_plan_pipeline", args)
    configs = [CONFIGS[0], CONFIGS[2]] if args.quick else CONFIGS
    rows = {}
    print(f"{'configuration':<30} {'stage':>5} {'loop':<12} {'planned':>9} {'measured':>9} {'err':>7}  "
          f"{'step planned':>12} {'measured':>9}  shim - profiler   saving planned / measured MiB")
    for label, shape, schedule, micro, engine in configs:
        r = rows[label] = compare(shape, schedule, micro, engine)
        for s in r["stages"]:
            for loop in LOOPS:
                x = s[loop]
                tail = (f"   {h.mib(s['saving']['planned'])} / {h.mib(s['saving']['measured'])}"
                        if loop == "standard" else "")
                print(f"{label:<30} {s['stage']:>5} {loop:<12} {h.mib(x['planned_peak']):>9} "
                      f"{h.mib(x['measured_peak']):>9} {100 * x['error']:>+6.2f}%  {h.mib(x['planned_step_peak']):>12} "
                      f"{h.mib(x['measured_step_peak']):>9}  {x['shim_minus_profiler_bytes']:>15}{tail}")
    return run.finish({"world": WORLD, "rows": rows})


if __name__ == "__main__":
    main()

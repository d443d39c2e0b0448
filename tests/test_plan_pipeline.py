"""The memory planner's pipeline stages: each stage rank planned on fake tensors in one process, against the same job
measured on 2 real gloo ranks (every thread's tensor bytes, heap_shim.c); the schedules it does not plan refused."""

from __future__ import annotations

import inspect
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_plan_pipeline
from benchmarks.bench_plan import _builders
from dist_optim import plan
from dist_optim._planner._cli import main
from dist_optim._planner._pipeline import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE
from launch import pipeline as launch_pipeline
from launch.gpt import loss_fn
from launch.pipeline import gpt_stage

AGREEMENT = 0.10  # issue 25: planned within 10 % of measured, the saving too
TINY = (2, 2, 64, 16, 2)  # n_layer, n_head, n_embd, block_size, micro-batch rows: the tests that plan only

needs_ranks = pytest.mark.skipif(
    not dist.is_available() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="needs torch.distributed and a C compiler (the heap shim counts gloo's threads' tensors)")


@needs_ranks
def test_each_stage_planned_agrees_with_its_gloo_rank_measured():
    # 1F1B over 4 micro-batches is the trainer's default: the accumulated gradients are alive before the last
    # backward, so in backward saves nothing on the first stage and 0.13 MB on the last (its backward of the last
    # micro-batch holds the outputs the schedule keeps); over one micro-batch nothing accumulates, and it saves
    # the gradients stepped before the peak of the stage's backward. Both rows measured by one group of 2 ranks
    # per loop.
    configs = [c for c in bench_plan_pipeline.CONFIGS if c[0] in ("1F1B, 2 x 256", "GPipe, 2 x 256, 1 micro-batch")]
    m = bench_plan_pipeline.measured_together(configs)
    for label, shape, schedule, micro, engine in configs:
        res = bench_plan_pipeline.compare(shape, schedule, micro, engine, m=m[label])
        for stage in res["stages"]:
            for loop in ("standard", "in_backward"):
                r = stage[loop]
                assert abs(r["error"]) <= AGREEMENT, (label, stage["stage"], loop, r["planned_peak"],
                                                      r["measured_peak"])
                assert abs(r["step_error"]) <= AGREEMENT, (label, stage["stage"], loop, r["planned_step_peak"],
                                                           r["measured_step_peak"])
                assert abs(r["planned_start"] / r["measured_start"] - 1) <= 0.01, label  # params, state, batch
            s = stage["saving"]
            assert abs(s["planned"] - s["measured"]) <= AGREEMENT * max(abs(s["measured"]), 1), (label, stage["stage"],
                                                                                                 s)
        if micro == 1:  # gradients stepped and freed in backward on both stages (0.40 and 0.53 MB here)
            assert all(stage["saving"]["planned"] > 2**18 for stage in res["stages"]), res["stages"]


def _plan(schedule: str = "1F1B", n: int = 4, **kw):
    model_fn, batch_fn, _ = _builders(TINY)
    return plan(model_fn, batch_fn, loss_fn, world_size=2, parallel="pp", pp_schedule=schedule, n_microbatches=n,
                pp_stage_fn=gpt_stage, bucket_cap_mb=0.5, lr=1e-3, **kw)


def test_each_stage_holds_its_blocks_and_a_receive_buffer_per_micro_batch():
    model_fn, batch_fn, _ = _builders(TINY)
    whole = plan(model_fn, batch_fn, lambda m, b: loss_fn(m(b[0]), b[1]), lr=1e-3)
    _, _, n_embd, block, rows = TINY
    activation = rows * block * n_embd * 4  # one micro-batch between the stages, float32
    for n in (2, 4):
        p = _plan(n=n)
        assert not dist.is_initialized()  # each stage's fake process group is destroyed
        assert sum(s.n_params for s in p.stages) == whole.n_params  # the stages partition the model
        # stage 0 receives the gradient of each micro-batch's output, stage 1 each micro-batch's input
        assert [s.options["recv_buffer_bytes"] for s in p.stages] == [n * activation] * 2
        assert [s.options["stage"] for s in p.stages] == [0, 1]
        top = max(p.stages, key=lambda s: max(s.standard.peak_bytes, s.in_backward.peak_bytes))
        assert p.options["stage"] == top.options["stage"] and p.standard.peak_bytes == top.standard.peak_bytes
    out = p.to_dict()
    assert len(out["stages"]) == 2 and out["options"]["pp_schedule"] == "Schedule1F1B"
    assert "per stage" in p.table() and "stage 1" in p.table()


def test_the_schedule_decides_the_micro_batches_in_flight():
    # on the first stage GPipe runs every forward before the first backward: one micro-batch more, one micro-batch's
    # activations more at the peak; 1F1B starts the backwards after num_stages forwards, whatever the count
    def activations(schedule: str, n: int) -> int:
        return _plan(schedule, n).stages[0].standard.breakdown["activations"]
    gpipe = [activations("GPipe", n) for n in (2, 3, 4)]
    assert gpipe[2] - gpipe[1] == gpipe[1] - gpipe[0] > 0, gpipe
    assert activations("1F1B", 4) == activations("1F1B", 8) < gpipe[2]


def test_the_defaults_are_the_trainers():
    assert DEFAULT_SCHEDULE.lower() == launch_pipeline.SCHEDULE
    assert DEFAULT_MICROBATCHES == launch_pipeline.MICROBATCHES
    defaults = inspect.signature(plan).parameters
    assert defaults["pp_schedule"].default == DEFAULT_SCHEDULE
    assert defaults["n_microbatches"].default == DEFAULT_MICROBATCHES


def test_schedules_and_options_not_planned_are_refused_by_name():
    for name in ("Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"):
        with pytest.raises(NotImplementedError, match=rf"pp_schedule='{name}' is not planned .*1F1B, GPipe"):
            _plan(name)
    with pytest.raises(NotImplementedError, match="not a torch.distributed.pipelining schedule.*1F1B, GPipe"):
        _plan("Wavefront")
    model_fn, batch_fn, _ = _builders(TINY)
    with pytest.raises(ValueError, match="parallel='pp' needs pp_stage_fn"):
        plan(model_fn, batch_fn, loss_fn, world_size=2, parallel="pp")
    with pytest.raises(ValueError, match="the schedule's micro-batches are the accumulation"):
        _plan(accumulation_steps=2)
    with pytest.raises(NotImplementedError, match="clip_mode='exact' with max_grad_norm under pipelining"):
        _plan(max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match="autocast_dtype with parallel='pp' is not planned"):
        _plan(autocast_dtype=torch.bfloat16)


def test_the_command_line_plans_every_stage(capsys):
    kwargs = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "tie_weights": False}
    args = ["--model", "launch.gpt:GPT", "--model-kwargs", json.dumps(kwargs), "--seq-len", "16", "--batch-size",
            "2", "--parallel", "pp", "--world", "2", "--pp-stage-fn", "launch.pipeline:gpt_stage"]
    p = main([*args, "--n-microbatches", "2", "--pp-schedule", "gpipe", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["pp_schedule"] == "ScheduleGPipe" and out["options"]["n_microbatches"] == 2
    assert [s["standard"]["peak_bytes"] for s in out["stages"]] == [s.standard.peak_bytes for s in p.stages]
    with pytest.raises(SystemExit, match="--pp-schedule Interleaved1F1B: .* is not planned"):
        main([*args, "--pp-schedule", "Interleaved1F1B"])
    with pytest.raises(SystemExit, match="--parallel pp needs --pp-stage-fn"):
        main([a for a in args if a not in ("--pp-stage-fn", "launch.pipeline:gpt_stage")])

"""The memory planner's layouts: one rank of a DDP or FSDP2 job (with accumulation too) or a TP job, planned on fake
tensors in one process, against the same job measured on 2 real gloo ranks (every thread's tensor bytes, heap_shim.c;
the mode of 5 steps; one group of ranks per loop measures every row); gloo's buffers inside FSDP2's collectives,
planned, and NCCL's, not; the layouts it does not plan refused."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_plan_layouts
from benchmarks.bench_plan import _builders
from dist_optim import plan
from dist_optim._planner._cli import main

AGREEMENT = 0.10  # issue 25: planned within 10 % of measured, the saving too
FSDP2_BYTES = 4096  # FSDP2 on gloo: the step's own peak and the saving this close (measured: to the byte, or 216 B)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "max_position_embeddings": 64, "tie_word_embeddings": False}

needs_ranks = pytest.mark.skipif(
    not dist.is_available() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="needs torch.distributed and a C compiler (the heap shim counts gloo's threads' tensors)")


def _assert_agrees(res: dict) -> None:
    for loop in ("standard", "in_backward"):
        r = res[loop]
        assert abs(r["error"]) <= AGREEMENT, (loop, r["planned_peak"], r["measured_peak"])
        assert abs(r["step_error"]) <= AGREEMENT, (loop, r["planned_step_peak"], r["measured_step_peak"])
    s = res["saving"]
    for measured in s["measured"]:  # every rank's
        assert abs(s["planned"] - measured) <= AGREEMENT * max(abs(measured), 1), s


DDP_ROWS = ("ddp, cap 0.5", "ddp, cap 0.5, views", "ddp, cap 0.5, accumulation 2", "ddp, cap 0.5, views, accumulation 2")
FSDP2_ROWS = ("fsdp2, 2 x 256, cap 0.5", "fsdp2, 2 x 256, accumulation 2")
TP_ROW = "tp, 2 x 256, cap 0.5"


# warm steps measured per rank, whose mode is the planned step (the benchmark measures 15). Under DDP and TP every step
# measures the same; under FSDP2 gloo frees some buffers late, on its own thread, and on a loaded machine that landed
# on 2 or 3 of 5 steps (the mode then off by 1-2.6 MB): 9 steps keep a majority of clean ones
FEW_STEPS = 9


def measured_rows(labels: tuple[str, ...], steps: int = FEW_STEPS) -> dict[str, dict]:
    """Each row planned and measured (bench_plan_layouts.compare), the rows measured by one group of gloo ranks per
    loop: the interpreters' start, not the steps, is what a row costs."""
    configs = [next(c for c in bench_plan_layouts.CONFIGS if c[0] == label) for label in labels]
    m = bench_plan_layouts.measured_together(configs, steps)
    return {label: bench_plan_layouts.compare(shape, layout, engine, steps=steps, m=m[label])
            for label, shape, layout, engine in configs}


def _assert_ddp_agrees(label: str, res: dict) -> None:
    _, _, layout, engine = next(c for c in bench_plan_layouts.CONFIGS if c[0] == label)
    _assert_agrees(res)
    for loop in ("standard", "in_backward"):  # the step's own peak to the byte: gloo's all-reduce allocates nothing
        assert res[loop]["planned_step_peak"] == res[loop]["measured_step_peak"], (label, res[loop])
    if layout.get("gradient_as_bucket_view") or engine.get("accumulation_steps", 1) > 1:
        # DDP's buckets hold every gradient in both loops, or the gradients accumulated under no_sync() are all
        # alive when the last backward starts: nothing to save
        assert res["saving"]["planned"] == 0, label
    else:  # the gradients copied into DDP's buckets are freed bucket by bucket in backward
        assert res["saving"]["planned"] > 2**20, label
    for loop in ("standard", "in_backward"):
        assert res[loop]["gloo_threads_bytes"] == [0, 0], label  # DDP's gloo collectives allocate no tensors


def _assert_fsdp2_agrees(label: str, res: dict) -> None:
    # The plan holds gloo's buffers inside FSDP2's collectives (communication: the all-gather's flat output, the
    # reduce-scatter's copy of its input) for each collective's duration. Gloo frees some of them late, on its own
    # thread, after the collective returned: a few of a rank's steps measure higher than the rest (headroom, stated in
    # the plan), so each rank's most frequent step peak of 5 is compared.
    for loop in ("standard", "in_backward"):
        r = res[loop]
        assert abs(r["error"]) <= AGREEMENT, (label, loop, r["planned_peak"], r["measured_peak"], r["ranks"])
        # tighter than the 10 %: the step's own peak to FSDP2_BYTES, the resident bytes to 1 %
        assert abs(r["planned_step_peak"] - r["measured_step_peak"]) <= FSDP2_BYTES, (label, loop, r["ranks"])
        assert abs(r["planned_start"] / r["measured_start"] - 1) <= 0.01, label  # the shards and their state
        assert r["breakdown"]["communication"] > 0, label  # gloo's buffers set the peak at this size
    s = res["saving"]
    for measured in s["measured"]:  # 0 planned and 0 measured on 2 x 256: gloo's buffers set both loops' peaks
        assert abs(s["planned"] - measured) <= AGREEMENT * abs(measured) + FSDP2_BYTES, (label, s)


def _assert_tp_agrees(res: dict) -> None:
    for loop in ("standard", "in_backward"):
        r = res[loop]
        assert abs(r["error"]) <= AGREEMENT, (loop, r["planned_peak"], r["measured_peak"], r["ranks"])
        assert abs(r["planned_start"] / r["measured_start"] - 1) <= 0.01, (loop, r["planned_start"],
                                                                            r["measured_start"])
        # DTensor's all-reduces allocate only their outputs: the step's own peak to the byte
        assert r["planned_step_peak"] == r["measured_step_peak"], r
    for measured in res["saving"]["measured"]:
        assert abs(res["saving"]["planned"] - measured) <= AGREEMENT * abs(measured), res["saving"]
    assert res["saving"]["planned"] > 2**20  # the MLPs' shards and the replicated rest, bucket by bucket


@needs_ranks
def test_ddp_fsdp2_and_tp_ranks_planned_agree_with_two_gloo_ranks_measured():
    """Every 2-rank row: DDP (cap 0.5; views; accumulation 2; both), FSDP2 (2 x 256; accumulation 2) and TP (2 x 256)
    planned against one group of 2 gloo ranks per loop measuring each row in turn."""
    rows = measured_rows((*DDP_ROWS, *FSDP2_ROWS, TP_ROW))
    for label in DDP_ROWS:
        _assert_ddp_agrees(label, rows[label])
    for label in FSDP2_ROWS:
        _assert_fsdp2_agrees(label, rows[label])
    _assert_tp_agrees(rows[TP_ROW])


def test_fsdp2_with_exact_clipping_holds_the_sharded_gradients_as_the_standard_loop_does():
    # in backward with exact clipping, every sharded gradient waits for the norm: the standard loop's step peak
    # (2 gloo ranks measured 73.36 MB for both loops on 4 x 512). Counting the DTensor wrappers' own storages (they
    # hold nothing) once planned it 73 % higher.
    model_fn, batch_fn, loss = _builders(bench_plan_layouts.SHAPE)
    p = plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", bucket_cap_mb=0.5, max_grad_norm=0.05,
             clip_mode="exact", lr=1e-3)
    assert abs(p.in_backward.step_peak_bytes / p.standard.step_peak_bytes - 1) < 0.01
    assert p.in_backward.breakdown["gradients"] <= 4 * p.n_params  # the rank's shards, no more


def _gpt(n_embd: int = 32):
    from launch.gpt import GPT

    return (lambda: GPT(64, 16, 2, 2, n_embd, tie_weights=False),
            lambda: (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()))


def test_a_ddp_rank_holds_ddps_buckets_beside_the_one_process_plan():
    model_fn, batch_fn, loss = _gpt()
    one = plan(model_fn, batch_fn, loss, lr=1e-3)
    ddp = plan(model_fn, batch_fn, loss, world_size=8, parallel="ddp", lr=1e-3)
    grads = 4 * one.n_params
    assert ddp.n_params == one.n_params  # every rank holds the whole model
    assert ddp.standard.start_bytes == one.standard.start_bytes + grads  # DDP's flat buckets, alive throughout
    assert ddp.standard.step_peak_bytes == one.standard.step_peak_bytes  # the step itself is the same
    assert ddp.standard.breakdown["gradients"] >= grads
    assert "ddp on 8 ranks" in ddp.table()


def test_layouts_not_planned_are_refused_by_name():
    model_fn, batch_fn, loss = _gpt()
    for parallel in ("zero3", "fsdp1"):
        with pytest.raises(NotImplementedError,
                           match=rf"parallel='{re.escape(parallel)}' is not planned \(unknown\).*'none', 'ddp', 'fsdp2', "
                                 r"'tp', 'fsdp2\+tp', 'hsdp', 'pp'"):
            plan(model_fn, batch_fn, loss, world_size=2, parallel=parallel)
    with pytest.raises(ValueError, match="one process plans world_size=1"):
        plan(model_fn, batch_fn, loss, world_size=2)
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\) or None .* got 'mpi'"):
        plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", backend="mpi")
    with pytest.raises(ValueError, match=r"backend='nccl' applies to a job on ranks"):
        plan(model_fn, batch_fn, loss, backend="nccl")


def test_the_command_line_plans_a_ddp_rank_and_refuses_a_pipeline_of_an_hf_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    p = main(["--hf-config", str(path), "--world", "8", "--parallel", "ddp", "--batch-size", "1", "--seq-len", "32",
              "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["parallel"] == "ddp" and out["options"]["world_size"] == 8
    assert out["options"]["layout"] == "per rank, ddp on 8 ranks"
    assert out["standard"]["peak_bytes"] == p.standard.peak_bytes
    with pytest.raises(SystemExit, match="--parallel pp: give --model and --pp-stage-fn"):
        main(["--hf-config", str(path), "--world", "8", "--parallel", "pp", "--batch-size", "1", "--seq-len", "32"])


def test_an_fsdp2_rank_holds_a_shard_and_the_fake_group_is_gone_after(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    args = ["--hf-config", str(path), "--batch-size", "1", "--seq-len", "32", "--json"]
    one = main(args)
    eight = main([*args, "--world", "8", "--parallel", "fsdp2"])
    capsys.readouterr()
    assert not dist.is_initialized()  # the planner's fake process group is destroyed
    # the decoder layers and the root sharded over 8 ranks: an eighth of each tensor (dim 0 padded to 8 rows)
    assert one.n_params / 8 <= eight.n_params < one.n_params / 8 + 8 * 64 * 20
    assert eight.standard.breakdown["optimizer_state"] < one.standard.breakdown["optimizer_state"] / 7
    assert eight.options["layout"] == "per rank, fsdp2 on 8 ranks"
    assert eight.standard.breakdown["communication"] > 0  # gloo's buffers inside FSDP2's collectives, on CPU
    assert any("gloo frees some late" in line for line in eight.not_seen)


def test_gloos_buffers_in_fsdp2s_collectives_are_planned_and_ncclss_are_not():
    model_fn, batch_fn, loss = _gpt()
    gloo = plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", lr=1e-3)  # CPU: gloo by default
    nccl = plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", backend="nccl", lr=1e-3)
    assert gloo.options["backend"] == "gloo" and nccl.options["backend"] == "nccl"  # by the device, when not given
    assert plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", backend="gloo",
                lr=1e-3).standard.peak_bytes == gloo.standard.peak_bytes
    model = model_fn()
    units = [4 * sum(p.numel() for p in m.parameters()) for m in model.blocks]  # unsharded bytes (float32)
    largest = max(*units, 4 * sum(p.numel() for p in model.parameters()) - sum(units))  # a block, or the root's own
    for g, n in zip(gloo.loops(), nccl.loops()):
        assert n.breakdown["communication"] == 0
        # at the peak: one all-gather's flat output or one reduce-scatter's copy of its input, a unit's bytes or less
        assert 0 < g.breakdown["communication"] <= largest + 64  # (+ FSDP2's padding to 2 ranks)
        assert n.peak_bytes <= g.peak_bytes <= n.peak_bytes + g.breakdown["communication"]
        assert g.start_bytes == n.start_bytes
    assert "communication" in gloo.table() and any("late" in line for line in gloo.not_seen)
    assert not any("gloo frees" in line for line in nccl.not_seen)

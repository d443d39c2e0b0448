"""The memory planner's tensor-parallel layouts: one rank of a TP (2 ranks), FSDP2 x TP (2 x 2) or HSDP (2 x 2) job,
planned on fake tensors over a fake process group and device mesh, against the same job measured on real gloo ranks
(every thread's tensor bytes, heap_shim.c; the TP row with the other 2-rank rows in test_plan_layouts.py); what the
plan's rank holds; the settings it refuses."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from test_plan_layouts import AGREEMENT, FSDP2_BYTES, TINY_LLAMA, measured_rows, needs_ranks

from benchmarks import bench_plan_layouts
from benchmarks.bench_plan import _builders
from dist_optim import plan
from dist_optim._planner._cli import main
from launch.memory_peak import allocator_peak
from launch.tensor_parallel import tensor_parallel

TINY = (2, 2, 64, 16, 2)  # n_layer, n_head, n_embd, block_size, batch: the fast, rank-free checks


def _assert_agrees(res: dict, step_bytes: int | None = None) -> None:
    """Each loop's peak, and the saving on every rank, within AGREEMENT of the measured one (each rank's most
    frequent step); with ``step_bytes``, the step's own peak and the saving within that many bytes too."""
    for loop in ("standard", "in_backward"):
        r = res[loop]
        assert abs(r["error"]) <= AGREEMENT, (loop, r["planned_peak"], r["measured_peak"], r["ranks"])
        assert abs(r["planned_start"] / r["measured_start"] - 1) <= 0.01, (loop, r["planned_start"],
                                                                            r["measured_start"])
        if step_bytes is not None:
            assert abs(r["planned_step_peak"] - r["measured_step_peak"]) <= step_bytes, (loop, r["ranks"])
    s = res["saving"]
    for measured in s["measured"]:
        assert abs(s["planned"] - measured) <= AGREEMENT * abs(measured) + (step_bytes or 0), s


@needs_ranks
def test_fsdp2_x_tp_and_hsdp_ranks_planned_agree_with_four_gloo_ranks_measured():
    """Both 4-rank rows measured by one group of 4 gloo ranks per loop (the 2-rank TP row is measured with the DDP and
    FSDP2 rows: test_plan_layouts.py)."""
    rows = measured_rows(("fsdp2+tp, 4 x 512, cap 0.5", "hsdp, 2 x 256, cap 0.5"))
    # gloo's buffers inside FSDP2's collectives over "dp" are planned (communication): the step's own peak to the byte
    res = rows["fsdp2+tp, 4 x 512, cap 0.5"]
    _assert_agrees(res, FSDP2_BYTES)
    assert res["saving"]["planned"] > 4 * 2**20
    # the mode of each rank's steps: where gloo frees a buffer earlier or later a step measures lower or higher than
    # the rest; the lowest would show a saving that the job does not have
    # the smaller model: HSDP's kept gradient buffers show at any size
    res = rows["hsdp, 2 x 256, cap 0.5"]
    _assert_agrees(res, FSDP2_BYTES)
    # FSDP2 keeps each unit's reduced gradient buffer (the all-reduce's input) until backward ends under HSDP: the
    # buckets step in backward and free nothing, on the real ranks as in the plan
    assert res["saving"]["planned"] == 0 and res["saving"]["measured"] == [0] * 4


def test_the_trace_holds_what_dtensor_redistributes_inside_an_operator():
    # x @ w with w sharded by rows: DTensor all-gathers w inside the matmul, and the gathered copy is alive while it
    # runs; the trace runs DTensor's own dispatch, so it sees the local operators and that copy, not only the output
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_optim._planner._memory_trace import MemoryTrace
    from dist_optim._planner._tp import fake_mesh
    from dist_optim._torch_internals import FakeTensorMode

    with fake_mesh((2,), ("tp",)) as mesh, FakeTensorMode():
        x = distribute_tensor(torch.empty(1024, 256), mesh, [Shard(0)])
        w = distribute_tensor(torch.empty(256, 256), mesh, [Shard(0)])
        (x @ w).sum()  # DTensor's sharding propagation, cached from here on (it runs on fake tensors of its own)
        trace = MemoryTrace()
        with trace:
            y = x @ w
            del y
        trace.finish()
    assert not dist.is_initialized()
    assert trace.peak == 512 * 256 * 4 + 256 * 256 * 4  # this rank's output rows and the whole of w


def _gpt_tp(**layout):
    model_fn, batch_fn, _ = _builders(TINY)
    return plan(model_fn, batch_fn, bench_plan_layouts._tp_loss, bucket_cap_mb=0.05, lr=1e-3, **layout)


def test_a_tp_rank_holds_the_mlp_shards_and_the_replicated_rest():
    model_fn, batch_fn, loss = _builders(TINY)
    one = plan(model_fn, batch_fn, loss, bucket_cap_mb=0.05, lr=1e-3)
    tp = _gpt_tp(world_size=2, parallel="tp", parallelize=tensor_parallel)
    n_layer, _, n_embd, _, _ = TINY
    mlp = n_layer * (2 * 4 * n_embd * n_embd + 4 * n_embd + n_embd)  # mlp.0 and mlp.2, weights and biases
    sharded = n_layer * (2 * 4 * n_embd * n_embd + 4 * n_embd) // 2  # mlp.2's bias is replicated
    assert tp.n_params == one.n_params - mlp + sharded + n_layer * n_embd
    for lp in tp.loops():
        assert lp.breakdown["parameters"] == 4 * tp.n_params  # float32, nothing else
        assert lp.breakdown["optimizer_state"] == 8 * tp.n_params + 4 * len(list(model_fn().parameters()))
    assert not dist.is_initialized()  # the fake process group is destroyed
    assert tp.options["mesh"] == {"tp": 2} and tp.options["parallelize"] == "launch.tensor_parallel.tensor_parallel"
    assert "tp on 2 ranks" in tp.table() and any("DTensor's redistributions" in s for s in tp.not_seen)


def test_fsdp2_x_tp_and_hsdp_ranks_hold_their_shards():
    tp = _gpt_tp(world_size=2, parallel="tp", parallelize=tensor_parallel)
    both = _gpt_tp(world_size=4, parallel="fsdp2+tp", tp_size=2, parallelize=tensor_parallel)
    assert tp.n_params / 2 <= both.n_params < tp.n_params / 2 + 2000  # the TP shards, halved over "dp" (padding)
    assert both.options["mesh"] == {"dp": 2, "tp": 2}
    assert "fsdp2+tp on 4 ranks (dp 2 x tp 2)" in both.table()
    model_fn, batch_fn, loss = _builders(TINY)
    # on NCCL, whose buffers the plan does not add: FSDP2's own memory (on gloo its buffers hide this small saving)
    fsdp2 = plan(model_fn, batch_fn, loss, world_size=2, parallel="fsdp2", bucket_cap_mb=0.05, backend="nccl", lr=1e-3)
    hsdp = plan(model_fn, batch_fn, loss, world_size=4, parallel="hsdp", shard_size=2, bucket_cap_mb=0.05,
                backend="nccl", lr=1e-3)
    assert hsdp.n_params == fsdp2.n_params  # sharded over the 2 ranks of "shard", replicated over "replicate"
    assert hsdp.standard.peak_bytes == fsdp2.standard.peak_bytes  # the all-reduce over "replicate" allocates nothing
    assert "hsdp on 4 ranks (replicate 2 x shard 2)" in hsdp.table()
    # under HSDP, FSDP2 holds each unit's reduced gradients to the end of backward: nothing for in backward to free
    assert hsdp.saving_bytes == 0 < fsdp2.saving_bytes


def test_planning_fsdp2_x_tp_allocates_nothing_of_the_models_size():
    # the device mesh's rank tensors are real (RealMeshOps runs them outside FakeTensorMode): a few bytes each
    model_fn, batch_fn, _ = _builders((2, 4, 1024, 64, 4))  # 25 M parameters: 400 MB with gradients and AdamW
    result = {}

    def run() -> None:
        result["plan"] = plan(model_fn, batch_fn, bench_plan_layouts._tp_loss, world_size=4, parallel="fsdp2+tp",
                              tp_size=2, parallelize=tensor_parallel, lr=1e-3)

    real = allocator_peak(run)["peak_bytes"]
    assert result["plan"].standard.peak_bytes > 10 * 2**20
    assert real < 5 * 2**20, real  # and the matrix products run once on rows cut to 4 MiB (outside_bytes)


def test_tp_settings_that_cannot_be_planned_are_refused():
    model_fn, batch_fn, loss = _builders(TINY)
    cases = [
        ({"world_size": 2, "parallel": "tp"}, ValueError, r"parallel='tp' needs parallelize"),
        ({"world_size": 4, "parallel": "tp", "tp_size": 2, "parallelize": tensor_parallel}, ValueError,
         r"tp_size must be None or world_size \(4\), got 2"),
        ({"world_size": 4, "parallel": "fsdp2+tp", "parallelize": tensor_parallel}, ValueError,
         r"needs tp_size, at least 2, a divisor of world_size \(4\) below it .* got None"),
        ({"world_size": 6, "parallel": "fsdp2+tp", "tp_size": 4, "parallelize": tensor_parallel}, ValueError, r"got 4"),
        ({"world_size": 4, "parallel": "hsdp", "shard_size": 4}, ValueError, r"needs shard_size.*got 4"),
        ({"world_size": 4, "parallel": "hsdp", "shard_size": 2, "parallelize": tensor_parallel}, NotImplementedError,
         r"HSDP x TP\) is not planned"),
        ({"world_size": 2, "parallel": "fsdp2", "tp_size": 2}, ValueError,
         r"apply to parallel in .* got parallel='fsdp2'"),
        ({"world_size": 2, "parallel": "tp", "parallelize": tensor_parallel, "accumulation_steps": 2},
         NotImplementedError, r"accumulation_steps > 1 with parallel='tp' is not planned"),
    ]
    for layout, error, match in cases:
        with pytest.raises(error, match=match):
            plan(model_fn, batch_fn, loss, lr=1e-3, **layout)

    def mlp_only(model, mesh):  # the MLPs sharded, the rest left plain
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    with pytest.raises(NotImplementedError, match=r"plain parameters next to DTensor ones \(wte.weight, .*replicated"):
        plan(model_fn, batch_fn, loss, world_size=2, parallel="tp", parallelize=mlp_only, lr=1e-3)
    assert not dist.is_initialized()


def test_the_command_line_plans_the_trainers_gpt_under_fsdp2_x_tp(tmp_path, capsys):
    n_layer, n_head, n_embd, block, batch = TINY
    gpt = ["--model", "launch.gpt:GPT", "--model-kwargs", json.dumps(
        {"vocab_size": 256, "block_size": block, "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
         "tie_weights": False}), "--seq-len", str(block), "--batch-size", str(batch), "--bucket-cap-mb", "0.05"]
    p = main([*gpt, "--world", "4", "--parallel", "fsdp2+tp", "--tp-size", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["mesh"] == {"dp": 2, "tp": 2}
    assert out["options"]["parallelize"] == "launch.tensor_parallel.tensor_parallel"
    assert out["standard"]["peak_bytes"] == p.standard.peak_bytes
    want = _gpt_tp(world_size=4, parallel="fsdp2+tp", tp_size=2, parallelize=tensor_parallel)
    assert p.n_params == want.n_params and p.saving_bytes == want.saving_bytes
    p = main([*gpt, "--world", "4", "--parallel", "hsdp", "--shard-size", "2"])
    assert "hsdp on 4 ranks (replicate 2 x shard 2)" in capsys.readouterr().out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(SystemExit, match=r"--parallel tp needs --parallelize MODULE:CALLABLE"):
        main(["--hf-config", str(path), "--world", "2", "--parallel", "tp"])

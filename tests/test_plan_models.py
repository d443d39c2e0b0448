"""The memory planner on models besides the trainer's GPT (issue 34), planned against the same step measured for
real (benchmarks/bench_plan_models.py): a ResNet with BatchNorm (its CPU convolutions' own allocations calibrated),
nn.TransformerEncoder (built by copy.deepcopy), an MoE, and the low-bit optimizers (planned from their own state):
both loops' peaks, the step's own peak and the saving within 10 %."""

from __future__ import annotations

import pytest
import torch
from test_plan import (  # issue 34: within 10 % of a real run, as the GPT's rows
    AGREEMENT,
    _assert_agrees,
)

from benchmarks import bench_plan_models as bench
from dist_optim._planner import _lowbit, _workspaces


@pytest.mark.parametrize("label", ["resnet-64, bf16, batch 2, AdamW", "resnet, fp32, batch 32, SGD",
                                   "TransformerEncoder, fp32", "MoE, fp32", "MoE, bf16"])
def test_a_model_planned_agrees_with_its_real_step(label):
    res = bench.row(label)
    _assert_agrees(res)
    if label.startswith("resnet"):  # the convolutions' own allocations, calibrated, in their own line
        assert res["standard"]["breakdown"]["workspaces"] > 0 or res["in_backward"]["breakdown"]["workspaces"] > 0
        assert any("CPU convolutions' own allocations, not traced but calibrated" in x for x in res["not_seen"])
    if "resnet-64" in label:
        assert res["saving"]["measured"] > 2**20  # the gradients set the peak: a saving to agree with


# AdamW4bit's real run (another 30 s of torchao compiling every shape) is in the benchmark; its state is checked below
@pytest.mark.parametrize("name", ["torchao.AdamW8bit", "bitsandbytes.AdamW8bit"])
def test_a_low_bit_optimizer_is_planned_from_its_state_and_agrees_with_its_real_step(name):
    pytest.importorskip(name.split(".")[0])
    cls = bench.low_bit(name)
    assert not _lowbit.steps_on_fake(cls)  # its step would kill the process (torchao) or read addresses (bnb)
    res = bench.row(next(k for k in bench.ROWS if k.endswith(name.replace(".", " "))))
    _assert_agrees(res)
    assert res["saving"]["measured"] > 2**20
    assert any(f"{cls.__name__}'s step, which cannot run on fake tensors" in x for x in res["not_seen"])


@pytest.mark.parametrize("name", ["torchao.AdamW8bit", "torchao.AdamW4bit", "bitsandbytes.AdamW8bit"])
def test_a_low_bit_state_extrapolated_from_two_probes_is_the_state_made_for_real(name):
    pytest.importorskip(name.split(".")[0])
    cls = bench.low_bit(name)
    for numel in (300_000, 300_032, 299_999):  # aligned to the blocks or not: the branch each class takes
        assert _lowbit.state_bytes(cls, (("lr", 1e-3),), numel, torch.float32) == \
            _lowbit._state_bytes(cls, {"lr": 1e-3}, numel, torch.float32)


def test_a_convolution_too_large_to_calibrate_is_run_on_a_cut_batch_and_scaled(monkeypatch):
    monkeypatch.setattr(_workspaces, "LIMIT_BYTES", 2**20)  # every convolution of batch 32 above it
    cut = bench.row("resnet, bf16, batch 32, AdamW")
    assert any("on a batch cut to fit, scaled by the batch" in x for x in cut["not_seen"])
    for loop in ("standard", "in_backward"):
        assert abs(cut[loop]["error"]) <= AGREEMENT, (loop, cut[loop]["planned_peak"], cut[loop]["measured_peak"])
        assert cut[loop]["breakdown"]["workspaces"] > 0

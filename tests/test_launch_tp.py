"""launch.train with ``--parallel tp`` (the MLPs sharded over two torchrun gloo ranks, the rest replicated DTensors)
and ``--parallel fsdp2+tp --tp-size 2`` (a (dp=2, tp=2) mesh on four): ``--compare`` bitwise against the standard
loop on the same parallelism, a stop and resume equal to the uninterrupted run, the four-rank checkpoint resumed on
one process, and the settings a TP run refuses."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from test_launch import TINY, _losses, _train, _train_runs

from launch import train
from launch.gpt import GPT
from launch.runtime import LaunchError, Runtime
from launch.tensor_parallel import check_tp
from launch.train_config import parse_config
from launch.train_loop import Job

TP = ["--parallel", "tp"]
FSDP2_TP = ["--parallel", "fsdp2+tp", "--tp-size", "2"]


def _ranks(world: int) -> Runtime:
    return Runtime(rank=0, world=world, local_rank=0, device=torch.device("cpu"), distributed=True)


# -- refused settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("world", "argv", "message"), [
    (2, ["--parallel", "fsdp2", "--tp-size", "2"], "--tp-size only applies to --parallel fsdp2+tp, and this run is "
                                                   "--parallel fsdp2"),
    (2, ["--parallel", "pp", "--tie-weights", "false", "--tp-size", "2"],
     "(pipeline stages with tensor parallel are not supported)"),
    (4, ["--parallel", "pp+fsdp2", "--pp-stages", "2", "--tie-weights", "false", "--tp-size", "2"],
     "--tp-size only applies to --parallel fsdp2+tp, and this run is --parallel pp+fsdp2"),
    (2, [*TP, "--tp-size", "4"], "--parallel tp runs one TP rank per process: --tp-size must be none or the number of "
                                 "processes (2), got 4"),
    (4, ["--parallel", "fsdp2+tp"], "--parallel fsdp2+tp needs --tp-size T"),
    (4, ["--parallel", "fsdp2+tp", "--tp-size", "3"], "--tp-size 3 must divide the number of processes (4)"),
    (4, ["--parallel", "fsdp2+tp", "--tp-size", "4"], "--tp-size 4 must divide the number of processes (4) and be "
                                                      "below it"),
    (4, [*FSDP2_TP, "--n-embd", "33", "--n-head", "3"], "--n-embd 33 must be a multiple of the tensor-parallel size 2 "
                                                        "(--tp-size)"),
    (4, [*TP, "--n-embd", "34"], "--n-embd 34 must be a multiple of the tensor-parallel size 4 (the number of "
                                 "processes)"),
])
def test_tp_settings_refused(world, argv, message):
    cfg = parse_config([*TINY, *argv])
    with pytest.raises(LaunchError, match=re.escape(message)):
        check_tp(cfg, _ranks(world), cfg.parallel)


def test_tp_needs_torchrun_and_pp_with_tp_is_no_choice(tmp_path, capsys):
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), *TP]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "launch.train: error: --parallel tp needs a process group: launch with torchrun"]
    with pytest.raises(SystemExit) as exc:
        parse_config(["--parallel", "pp+tp"])
    assert exc.value.code == 2 and "argument --parallel: invalid choice: 'pp+tp'" in capsys.readouterr().err


def test_batch_splits_over_the_replicas_not_the_tp_ranks():
    cfg = parse_config([*TINY, *FSDP2_TP, "--batch-size", "6", "--accumulation-steps", "2"])
    with pytest.raises(LaunchError, match=re.escape(  # refused before the model is built
            "--batch-size 6 must be a multiple of the data-parallel replicas (world / TP size) x "
            "--accumulation-steps = 2 x 2 = 4: pass e.g. --batch-size 8")):
        Job(cfg, _ranks(4), None, "fsdp2+tp", "in_backward")


# -- torchrun -----------------------------------------------------------------------------------------------------
def _compare(tmp_path, run: str, opts: list[str], nproc: int, out) -> dict:
    """--compare's run ``run`` (``out``: its output): bitwise losses and gradient norms; returns the report."""
    assert "losses max |diff| 0 (bitwise equal: True)" in out.stderr
    assert "returned a view tensor" not in out.stderr  # FSDP2's warning about the root's output, once unwrapped in it
    report = json.loads((tmp_path / run / "compare" / "report.json").read_text())
    assert report["parallel"] == opts[1] and report["world_size"] == nproc and report["losses_bitwise_equal"]
    assert len(report["losses"]["in_backward"]) == 6 and report["max_abs_loss_diff"] == 0.0
    norms = report["grad_norms"]
    assert norms["in_backward"] == norms["standard"] and all(n > 0 for n in norms["standard"])
    return report


def _tp_gradient_bytes(tp: int) -> int:
    """A TP rank's float32 gradient bytes of the TINY model: mlp.0 (weight, bias) and mlp.2's weight split in tp
    parts, everything else whole."""
    model = GPT(256, 32, 2, 2, 32)
    split = [p.numel() for n, p in model.named_parameters() if n.endswith(("mlp.0.weight", "mlp.0.bias",
                                                                           "mlp.2.weight"))]
    return 4 * (sum(p.numel() for p in model.parameters()) - sum(split) + sum(split) // tp)


def test_tp_compares_bitwise_with_two_pass_and_per_parameter_clipping_and_resumes_bitwise(tmp_path):
    opts = [*TP, "--accumulation-steps", "2", "--max-grad-norm", "0.05", "--clip-mode", "two_pass"]
    per_parameter = [*TP, "--max-grad-norm", "0.05", "--clip-mode", "per_parameter", "--track-grad-norm"]
    # the stopped run shares the comparisons' launch; its resume has a launch of its own
    outs = _train_runs(tmp_path, [("cmp", [*opts, "--compare"]), ("per_parameter", [*per_parameter, "--compare"]),
                                  ("part", [*opts, "--stop-after", "2", "--checkpoint-every", "3"])], nproc=2)
    report = _compare(tmp_path, "cmp", opts, 2, outs[0])
    assert report["gradient_bytes_per_rank"] == [_tp_gradient_bytes(2)] * 2  # the MLPs are sharded
    _compare(tmp_path, "per_parameter", per_parameter, 2, outs[1])
    full = report["losses"]["in_backward"]
    assert len(_losses(tmp_path, "part")) == 3
    out = _train(tmp_path, "part", *opts, "--resume", "latest", nproc=2)
    assert "resumed from" in out.stderr and "step_00000002" in out.stderr
    assert _losses(tmp_path, "part") == full


def test_fsdp2_tp_compares_bitwise_and_resumes_on_four_and_on_one_process(tmp_path):
    clip = ["--accumulation-steps", "2", "--max-grad-norm", "0.05"]  # exact clipping
    (out, _) = _train_runs(tmp_path, [("cmp", [*FSDP2_TP, *clip, "--compare"]),
                                      ("part", [*FSDP2_TP, *clip, "--stop-after", "2", "--checkpoint-every", "3"])],
                           nproc=4)
    full = _compare(tmp_path, "cmp", [*FSDP2_TP, *clip], 4, out)["losses"]["in_backward"]
    shutil.copytree(tmp_path / "part", tmp_path / "part1")
    _train(tmp_path, "part", *FSDP2_TP, *clip, "--resume", "latest", nproc=4)
    assert _losses(tmp_path, "part") == full
    # the (dp=2, tp=2) checkpoint into the plain model on one process: the global batch, reduced in another order
    out = _train(tmp_path, "part1", *clip, "--resume", "latest")
    assert "saved by 4 process(es)" in out.stderr
    assert _losses(tmp_path, "part1")[:3] == full[:3]
    assert _losses(tmp_path, "part1") == pytest.approx(full, rel=1e-5, abs=1e-6)

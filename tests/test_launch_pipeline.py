"""launch.train with ``--parallel pp``: the GPT cut into two pipeline stages on two torchrun gloo ranks, each stage
stepped in its last micro-batch backward, checked against the standard loop on the same schedule and against an
uninterrupted run after a stop and a resume; the same for ``--parallel pp+fsdp2`` (two stages, each sharded over
two of four ranks); and the settings a pipeline run refuses."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch
from test_launch import TINY, _losses, _train, _train_runs

from launch import train
from launch.gpt import GPT
from launch.pipeline import GPTStage, check_pipeline, stage_blocks
from launch.run_dir import _decide_stages
from launch.runtime import LaunchError, Runtime
from launch.train_config import parse_config

PP = ["--parallel", "pp", "--tie-weights", "false"]


# -- the split --------------------------------------------------------------------------------------------------
def test_stages_cover_the_blocks_and_keep_the_models_names():
    assert [stage_blocks(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_blocks(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    torch.manual_seed(0)
    gpt = GPT(256, 16, 3, 2, 16, tie_weights=False)
    stages = [GPTStage(gpt, *stage_blocks(3, 2, s), first=s == 0, last=s == 1) for s in range(2)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in gpt.named_parameters())  # each parameter on one stage, same name
    idx = torch.randint(256, (2, 16))
    assert torch.equal(stages[1](stages[0](idx)), gpt(idx))  # the stages in a row are the model


# -- refused settings ---------------------------------------------------------------------------------------------
def test_pp_with_fsdp2_needs_torchrun(tmp_path, capsys):
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--parallel", "pp+fsdp2"]) == 2
    err = capsys.readouterr().err
    one_line = "launch.train: error: --parallel pp+fsdp2 needs a process group: launch with torchrun"
    assert err.strip().splitlines() == [one_line]


def test_pipeline_options_without_pp_are_refused(tmp_path, capsys):
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--microbatches", "2", "--pp-schedule", "gpipe"]) == 2
    err = capsys.readouterr().err
    assert ("--microbatches, --pp-schedule only apply to --parallel pp or pp+fsdp2, and this run is --parallel none"
            in err)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "--parallel pp needs --tie-weights false"),
    (["--tie-weights", "false", "--pp-stages", "4"], "--pp-stages must equal the number of processes (2)"),
    (["--tie-weights", "false", "--n-layer", "1"], "--n-layer 1 gives fewer blocks than the 2 stages"),
    (["--tie-weights", "false", "--accumulation-steps", "2"], "the schedule's micro-batches are the accumulation"),
    (["--tie-weights", "false", "--microbatches", "3"], "batch_size must be a multiple of --microbatches 3"),
    (["--tie-weights", "false", "--max-grad-norm", "1"], "--clip-mode exact with --parallel pp: the norm spans"),
])
def test_pipeline_settings_refused(argv, message):
    cfg = parse_config([*TINY, "--parallel", "pp", *argv])
    two_ranks = Runtime(rank=0, world=2, local_rank=0, device=torch.device("cpu"), distributed=True)
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(cfg, two_ranks, "pp")


PP_FSDP2 = ["--parallel", "pp+fsdp2", "--tie-weights", "false", "--pp-stages", "2"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--parallel", "pp+fsdp2", "--tie-weights", "false"], "--parallel pp+fsdp2 needs --pp-stages S: the 4 processes"),
    (["--parallel", "pp+fsdp2", "--tie-weights", "false", "--pp-stages", "3"],
     "--pp-stages 3 must divide the number of processes (4)"),
    (["--parallel", "pp+fsdp2", "--tie-weights", "false", "--pp-stages", "4"],
     "with --pp-stages 4 on 4 processes leaves one rank per stage, with nothing to shard over; use --parallel pp"),
    (["--parallel", "pp+fsdp2", "--pp-stages", "2"], "--parallel pp+fsdp2 needs --tie-weights false"),
    ([*PP_FSDP2, "--accumulation-steps", "2"], "with --parallel pp+fsdp2: the schedule's micro-batches are the"),
    ([*PP_FSDP2, "--microbatches", "8"], "multiple of --microbatches 8 x the 2 ranks per stage"),
    ([*PP_FSDP2, "--max-grad-norm", "1"], "--clip-mode exact with --parallel pp+fsdp2: the norm spans"),
    ([*PP_FSDP2, "--max-grad-norm", "1", "--clip-mode", "previous_norm"],
     "--clip-mode previous_norm with --parallel pp+fsdp2: the norm spans"),
])
def test_pipeline_x_fsdp2_settings_refused(argv, message):
    cfg = parse_config([*TINY, *argv])
    four_ranks = Runtime(rank=0, world=4, local_rank=0, device=torch.device("cpu"), distributed=True)
    with pytest.raises(LaunchError, match=re.escape(message)):
        check_pipeline(cfg, four_ranks, "pp+fsdp2")


# -- torchrun: two stages on two ranks (pp), or each sharded over two of four (pp+fsdp2) --------------------------------
def _compare_then_resume(tmp_path: pathlib.Path, opts: list[str], nproc: int,
                         more: tuple[tuple[str, list[str]], ...] = ()) -> list[float]:
    """--compare bitwise (losses and the model's grad norm), then a run stopped after step 2 with a checkpoint per
    step, resumed over a step one stage missed: the uninterrupted run's losses, which it returns. The comparison,
    the runs ``more`` and the stopped run share a launch; the resume has one of its own."""
    stopped = ("part", [*opts, "--stop-after", "2", "--checkpoint-every", "1", "--keep-checkpoints", "2"])
    out, *_ = _train_runs(tmp_path, [("cmp", [*opts, "--compare"]), *more, stopped], nproc=nproc)
    assert "losses max |diff| 0 (bitwise equal: True)" in out.stderr
    report = json.loads((tmp_path / "cmp" / "compare" / "report.json").read_text())
    assert report["parallel"] == opts[1] and report["world_size"] == nproc and report["losses_bitwise_equal"]
    full = report["losses"]["in_backward"]
    assert len(full) == 6 and full == report["losses"]["standard"]
    norms = report["grad_norms"]
    assert norms["in_backward"] == norms["standard"] and all(n > 0 for n in norms["standard"])
    folder = tmp_path / "part" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["stage0", "stage1"]  # one folder per stage, not per rank
    for stage in folder.iterdir():  # pruned to 2 once both stages had saved each step
        assert sorted(p.name for p in stage.iterdir()) == ["step_00000001", "step_00000002"]
        # saved by every rank of the stage
        assert json.loads((stage / "step_00000002" / "dist_optim.json").read_text())["world_size"] == nproc // 2
    # a kill between the stages' saves of step 2: stage 0 committed it, stage 1 did not
    shutil.rmtree(folder / "stage1" / "step_00000002")
    out = _train(tmp_path, "part", *opts, "--resume", "latest", nproc=nproc)
    assert "steps 2 were saved by some stages only (stage0: steps 1, 2; stage1: steps 1): deleted" in out.stderr
    assert "resumed from" in out.stderr and "stage0/step_00000001" in out.stderr
    assert _losses(tmp_path, "part") == full
    return full


def test_pp_1f1b_and_gpipe_equal_standard_loop_and_1f1b_resumes_bitwise(tmp_path):
    # gpipe: 3 micro-batches of 2 sequences: the optimizer divides by 3 as the schedule does (x * (1/3) would differ);
    # --compare runs both optimizer modes in one job
    gpipe = [*PP, "--pp-schedule", "gpipe", "--batch-size", "6", "--microbatches", "3", "--track-grad-norm"]
    _compare_then_resume(tmp_path, [*PP, "--microbatches", "4", "--max-grad-norm", "0.05", "--clip-mode",
                                    "per_parameter", "--track-grad-norm"], nproc=2,
                         more=(("gpipe", [*gpipe, "--compare"]),))
    report = json.loads((tmp_path / "gpipe" / "compare" / "report.json").read_text())
    assert report["config"]["pp_schedule"] == "gpipe" and report["config"]["microbatches"] == 3
    losses = report["losses"]
    assert len(losses["in_backward"]) == 6 and losses["in_backward"] == losses["standard"]
    norms = report["grad_norms"]
    assert norms["in_backward"] == norms["standard"] and all(n > 0 for n in norms["standard"])  # the model's norm


def test_pp_fsdp2_equals_standard_loop_and_resumes_bitwise(tmp_path):
    clip = ["--max-grad-norm", "0.05", "--clip-mode", "per_parameter"]
    # each of the 2 pipelines takes 4 of the 8 sequences, in 2 micro-batches
    # the stopped run after the comparison in one launch: its stage meshes are new ones, not the comparison's from
    # DTensor's cache (launch/runtime.stop clears it)
    full = _compare_then_resume(tmp_path, [*PP_FSDP2, "--microbatches", "2", *clip, "--track-grad-norm"], nproc=4)
    # the global batch, as one process trains on it: equal up to the order of the sums (means per micro-batch and
    # per pipeline, the reduce-scatter); two pipelines on the same half would differ from step 0 on
    _train(tmp_path, "one", "--tie-weights", "false", *clip)
    assert _losses(tmp_path, "one") == pytest.approx(full, rel=1e-5)


HELD = [([1, 2], None), ([1], None)]  # stage 1 was killed before committing step 2


@pytest.mark.parametrize(("argv", "held", "message"), [
    ([], HELD, r"holds the checkpoints of another run \(stage0: steps 1, 2; stage1: steps 1\)"),
    (["--resume", "latest"], [([2], None), ([], None)], "no step was saved by every stage"),
    (["--resume", "2"], HELD, "step 2 was not saved by every stage"),
    (["--resume", "PATH"], [([1, 2], True), ([1], False)], r"stage\(s\) 1 have no committed step_00000002"),
    (["--resume", "1"], [([1, 2], None), ([1, 2], None)], r"holds later checkpoints \(steps 2\)"),
])
def test_pipeline_resume_needs_a_step_every_stage_saved(tmp_path, argv, held, message):
    directory = tmp_path / "r" / "checkpoints"
    argv = [a.replace("PATH", str(directory / "stage0" / "step_00000002")) for a in argv]
    cfg = parse_config([*TINY, *PP, "--run-dir", str(tmp_path / "r"), *argv])
    with pytest.raises(LaunchError, match=message):
        _decide_stages(cfg, directory, held)


def test_pipeline_resume_latest_skips_a_step_one_stage_missed(tmp_path):
    directory = tmp_path / "r" / "checkpoints"
    cfg = parse_config([*TINY, *PP, "--run-dir", str(tmp_path / "r"), "--resume", "latest"])
    plan, doomed = _decide_stages(cfg, directory, HELD)
    assert plan.resume_from == directory / "stage0" / "step_00000001" and doomed == [2]
    fresh = parse_config([*TINY, *PP, "--run-dir", str(tmp_path / "r"), "--overwrite"])
    assert _decide_stages(fresh, directory, HELD) == (type(plan)(None), [1, 2])

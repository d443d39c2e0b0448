"""``launch.train --plan``: the job the flags describe, planned for one rank of its layout instead of run. Each
layout's plan is the one ``dist_optim.plan`` gives for that layout called directly, with the micro-batch the run's
own batch split hands a rank; the one-process plan is checked against ``--compare``'s measurement of the same job;
what the planner cannot plan is a one-line error."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

import dist_optim
from launch import train
from launch.corpus import VOCAB_SIZE, Corpus
from launch.gpt import GPT, loss_fn
from launch.optimizers import optimizer_kwargs
from launch.pipeline import check_pipeline, gpt_stage, stage_of
from launch.runtime import Runtime
from launch.tensor_parallel import check_tp, data_parallel, tensor_parallel
from launch.train_config import parse_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = str(pathlib.Path(sys.executable).with_name("torchrun"))
# a GPT whose plans take seconds, its gradients (1.6 MiB) above its activations: the in-backward peak depends on
# the bucket cap, and --plan's would differ from the direct plan's if it passed another
SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 128, "block_size": 4}
TINY = [*(x for k, v in SHAPE.items() for x in (f"--{k.replace('_', '-')}", str(v))), "--batch-size", "8",
        "--bucket-cap-mb", "0.25", "--threads", "1"]
# --parallel: (processes, the trainer's flags, dist_optim.plan's arguments for that layout, as the trainer runs it)
LAYOUTS = {
    "none": (1, ["--accumulation-steps", "2", "--max-grad-norm", "1", "--clip-mode", "two_pass"], {}),
    "ddp": (2, ["--accumulation-steps", "2"], {}),  # no_sync() on the first micro-batch, in both loops
    "fsdp2": (4, ["--accumulation-steps", "2"], {"fsdp_units": lambda model: list(model.blocks)}),  # blocks, root
    "tp": (2, [], {"parallelize": tensor_parallel}),
    "fsdp2+tp": (4, ["--tp-size", "2"], {"tp_size": 2, "parallelize": tensor_parallel,
                                         "fsdp_units": lambda model: list(model.blocks)}),
    "pp": (2, ["--tie-weights", "false", "--microbatches", "2", "--pp-schedule", "gpipe", "--max-grad-norm", "1",
               "--clip-mode", "per_parameter"],
           {"n_microbatches": 2, "pp_schedule": "GPipe", "pp_stage_fn": gpt_stage}),
}


def _run_micro_batches(argv: list[str], world: int) -> list[torch.Tensor]:
    """Rank 0's inputs of one step's micro-batches, as the run draws them: the trainer's data-parallel split
    (``data_parallel``, ``stage_of``) and ``Corpus.micro_batches``, then under pp the schedule's own split."""
    cfg = parse_config(argv)
    parallel = cfg.parallel if cfg.parallel != "auto" else ("fsdp2" if world > 1 else "none")
    rt = Runtime(rank=0, world=world, local_rank=0, device=torch.device("cpu"), distributed=world > 1)
    corpus = Corpus(0.01, cfg.block_size, cfg.seed)
    stages = check_pipeline(cfg, rt, parallel)
    if stages:
        from torch.distributed.pipelining.microbatch import (
            split_args_kwargs_into_chunks,
        )

        _, replica = stage_of(rt, stages)
        ((x, _),) = corpus.micro_batches(0, cfg.batch_size, replica, world // stages, 1)
        chunks, _ = split_args_kwargs_into_chunks((x,), {}, cfg.microbatches)
        return [c[0] for c in chunks]
    dp_rank, dp_size = data_parallel(rt, parallel, check_tp(cfg, rt, parallel))
    return [x for x, _ in corpus.micro_batches(0, cfg.batch_size, dp_rank, dp_size, cfg.accumulation_steps)]


def _logits_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return loss_fn(logits.to_local() if isinstance(logits, DTensor) else logits, batch[1])  # TP: replicated


def _figures(d: object) -> object:
    """A plan's numbers: its JSON without the options and timelines, and without the first step's peak, which
    under FSDP2 and TP depends on what the process traced before (one-time caches of the first trace in a process:
    a known open point, docs/planning.md), and without what kernels keep outside torch's allocator, measured on
    each kernel's first run in the process (the second plan reuses the first's figures for the kernels both ran)."""
    if isinstance(d, dict):
        return {k: _figures(v) for k, v in d.items()
                if k not in ("options", "timeline", "first_step_peak_bytes", "run_peak_bytes", "outside_bytes")}
    if isinstance(d, list):
        return [_figures(v) for v in d if not (isinstance(v, str) and v.startswith("kept outside torch's allocator"))]
    return d


@pytest.mark.parametrize("parallel", list(LAYOUTS))
def test_plan_is_dist_optim_plan_of_the_layout_on_the_runs_micro_batch(parallel, tmp_path, capsys):
    world, flags, layout = LAYOUTS[parallel]
    # fsdp2 is what --parallel auto (the default) picks for several processes
    argv = [*TINY, *(["--parallel", parallel] if parallel != "fsdp2" else []), *flags]
    assert train.main([*argv, "--nproc", str(world), "--run-dir", str(tmp_path), "--plan"]) == 0
    out = capsys.readouterr().out
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.png").exists() and not (tmp_path / "metrics.jsonl").exists()
    micro = _run_micro_batches(argv, world)
    assert planned["options"]["micro_batch"] == list(micro[0].shape)
    assert planned["options"]["micro_batches_per_step"] == len(micro)
    where = "one process" if parallel == "none" else f"--parallel {parallel} on {world} processes (--nproc)"
    assert out.startswith(f"planned: {where}") and "saving:" in out

    cfg = parse_config(argv)
    shape = micro[0].shape
    direct = dist_optim.plan(
        lambda: GPT(VOCAB_SIZE, **SHAPE, tie_weights=cfg.tie_weights),
        lambda: (torch.randint(0, VOCAB_SIZE, shape), torch.randint(0, VOCAB_SIZE, shape)),
        loss_fn if parallel == "pp" else _logits_loss,
        torch.optim.AdamW, bucket_cap_mb=cfg.bucket_cap_mb, accumulation_steps=1 if parallel == "pp" else len(micro),
        max_grad_norm=cfg.max_grad_norm, clip_mode=cfg.clip_mode,
        parallel=parallel, world_size=world, **layout, **optimizer_kwargs("adamw", cfg, torch.device("cpu")))
    assert _figures(planned) == _figures(direct.to_dict())
    assert planned["options"]["layout"] == direct.options["layout"]


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", "nccl")])
def test_plan_takes_the_runs_backend(device, backend, tmp_path, capsys):
    """The run's process group: gloo on CPU (its buffers inside FSDP2's collectives planned), NCCL on CUDA (none
    planned; the output says NCCL's own are not seen). Planned on this CPU either way: nothing runs on the device."""
    argv = [*TINY, "--parallel", "fsdp2", "--nproc", "2", "--device", device, "--run-dir", str(tmp_path), "--plan"]
    assert train.main(argv) == 0
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert planned["options"]["backend"] == backend
    communication = [planned[loop]["breakdown"]["communication"] for loop in ("standard", "in_backward")]
    assert (min(communication) > 0) == (backend == "gloo"), communication
    assert ("NCCL's own buffers" in capsys.readouterr().out) == (backend == "nccl")


def test_plan_under_torchrun_rank_0_plans_the_job_of_its_world_size(tmp_path):
    """torchrun's WORLD_SIZE is the job's: rank 0 plans and writes, the other exits."""
    out = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "launch.train", *TINY, "--plan",
                          "--parallel", "ddp", "--run-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("planned: --parallel ddp on 2 processes (torchrun), per rank") == 1, out.stdout
    options = json.loads((tmp_path / "plan.json").read_text())["options"]
    assert (options["parallel"], options["world_size"], options["world_from"]) == ("ddp", 2, "torchrun")
    assert options["micro_batch"] == [4, SHAPE["block_size"]]


def test_plan_predicts_the_peaks_and_the_saving_compare_measures(tmp_path, capsys):
    """--plan against --compare's own measurement of the same job (allocator peaks of one warm step): gradients
    above the activations at this shape, so that the saving shows."""
    job = ["--n-layer", "2", "--n-head", "4", "--n-embd", "256", "--block-size", "32", "--batch-size", "4",
           "--corpus-mb", "0.25", "--steps", "3", "--warmup-steps", "1", "--threads", "1", "--log-every", "100",
           "--bucket-cap-mb", "0.5"]
    assert train.main([*job, "--run-dir", str(tmp_path / "plan"), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "saving:" in out and "not seen:" in out and (tmp_path / "plan" / "plan.json").exists()
    assert not (tmp_path / "plan" / "metrics.jsonl").exists()  # planned, not run
    planned = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert train.main([*job, "--run-dir", str(tmp_path / "run"), "--compare"]) == 0
    measured = json.loads((tmp_path / "run" / "compare" / "report.json").read_text())["peak_memory_bytes_per_rank"]
    for loop in ("standard", "in_backward"):
        assert abs(planned[loop]["step_peak_bytes"] / measured[loop][0] - 1) <= 0.10, (loop, planned, measured)
    saving = measured["standard"][0] - measured["in_backward"][0]
    assert saving > 2**20 and abs(planned["saving_bytes"] / saving - 1) <= 0.10, (planned["saving_bytes"], saving)


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--optimizer", "muon"], {}, "--optimizer muon trains param groups of two (Muon and AdamW)"),
    (["--parallel", "ddp"], {}, "--plan --parallel ddp plans a job of several processes: give their number with "
                                "--nproc N"),
    (["--parallel", "none", "--nproc", "2"], {}, "--parallel none with 2 processes would train 2 unrelated models"),
    (["--nproc", "2"], {"WORLD_SIZE": "4"}, "--nproc 2 under torchrun, which started 4 processes"),
    (["--parallel", "pp+fsdp2", "--nproc", "4", "--pp-stages", "2", "--tie-weights", "false"], {},
     "--plan --parallel pp+fsdp2 (--pp-stages 2): dist_optim.plan plans one pipeline stage per rank"),
    (["--parallel", "tp", "--nproc", "2", "--accumulation-steps", "2"], {},
     "--plan --accumulation-steps 2 with --parallel tp: dist_optim.plan plans accumulation on one process, DDP"),
    (["--parallel", "tp", "--nproc", "2", "--n-embd", "33", "--n-head", "3"], {}, "--n-embd 33 must be a multiple"),
    (["--compare"], {}, "--plan and --compare"),
])
def test_plan_refuses_what_it_cannot_plan_in_one_line(flags, env, message, tmp_path, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert train.main([*TINY, "--run-dir", str(tmp_path), "--plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("launch.train: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "plan.json").exists()


def test_nproc_sizes_a_plan_only(tmp_path, capsys):
    assert train.main([*TINY, "--run-dir", str(tmp_path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("launch.train: error: --nproc 2 sizes the job --plan plans; to run on 2 processes, launch with "
                   "torchrun --nproc-per-node 2")

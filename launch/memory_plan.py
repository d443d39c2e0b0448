"""``launch.train --plan``: the job the flags describe, its memory planned on fake tensors (``dist_optim.plan``)
instead of trained, for one representative rank of its layout.

The layout is the run's (``--parallel`` none, ddp, fsdp2, tp, fsdp2+tp or pp, resolved and checked by the trainer's
own functions), over the world size torchrun gives (``WORLD_SIZE``: rank 0 plans, the others exit at once) or
``--nproc N`` without torchrun: no process group either way, the planner's fake one stands in. The model, each
rank's micro-batch (the trainer's split of ``--batch-size`` over the data-parallel ranks and micro-batches), the
optimizer's class and options, bucket cap, clipping and accumulation are the run's. The table is printed,
RUN_DIR/plan.json (and plan.png, with matplotlib) written. What the planner cannot plan is a one-line error.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import dist_optim

from .corpus import VOCAB_SIZE
from .gpt import from_config, loss_fn
from .optimizers import OPTIMIZERS, check_parallel, optimizer_class, optimizer_kwargs
from .pipeline import MICROBATCHES, SCHEDULE, check_pipeline, gpt_stage
from .runtime import LaunchError, Runtime
from .tensor_parallel import TENSOR_PARALLEL, batch_split, check_tp, tensor_parallel
from .train_config import MODEL_SHAPE, TrainConfig
from .wrapping import resolve_parallel

__all__ = ["PlannedJob", "plan_arguments", "plan_memory", "planned_job"]


@dataclass(frozen=True)
class PlannedJob:
    """The job ``--plan`` plans, as the run would lay it out on rank 0."""

    parallel: str  # the resolved --parallel
    world: int  # processes in the job
    world_from: str  # where the world size came from: "--nproc", "torchrun" or "one process"
    tp_size: int  # tensor-parallel ranks per replica (0: none)
    stages: int  # pipeline stages (0: no pipeline)
    micro_batch: tuple[int, int]  # one rank's micro-batch: (sequences, tokens)
    micro_batches: int  # micro-batches per optimizer step: --accumulation-steps, or the schedule's --microbatches

    def describe(self) -> str:
        rows, tokens = self.micro_batch
        where = ("one process" if self.parallel == "none" else
                 f"--parallel {self.parallel} on {self.world} processes ({self.world_from}), per "
                 f"{'stage ' if self.stages else ''}rank")
        return f"planned: {where}; micro-batch {rows} x {tokens} tokens, {self.micro_batches} per step"


def planned_job(cfg: TrainConfig, environ: Mapping[str, str] = os.environ) -> PlannedJob:
    """The layout, world size and per-rank batch of ``cfg``'s job (``environ``: torchrun's variables, if any), or a
    LaunchError naming the flag the planner cannot take."""
    if cfg.compare:
        raise LaunchError("--plan and --compare: the one plans both loops, the other runs them; choose one")
    if OPTIMIZERS[cfg.optimizer].matrices is not None:
        raise LaunchError(f"--plan plans one optimizer class over the model; --optimizer {cfg.optimizer} trains "
                          "param groups of two (Muon and AdamW), which the planner does not take")
    world, source = int(environ.get("WORLD_SIZE", "0")), "torchrun"
    if not world:
        world, source = (1, "one process") if cfg.nproc is None else (cfg.nproc, "--nproc")
    elif cfg.nproc is not None and cfg.nproc != world:
        raise LaunchError(f"--nproc {cfg.nproc} under torchrun, which started {world} processes: drop --nproc (the "
                          "job's size is torchrun's) or launch without torchrun")
    if cfg.parallel not in ("auto", "none") and source == "one process":
        raise LaunchError(f"--plan --parallel {cfg.parallel} plans a job of several processes: give their number "
                          "with --nproc N (or launch with torchrun)")
    # rank 0 as the run would see it; planning calls no collective, so no process group stands behind it
    rt = Runtime(rank=0, world=world, local_rank=0, device=torch.device("cpu"), distributed=source != "one process")
    parallel = resolve_parallel(cfg.parallel, rt)
    check_parallel(cfg.optimizer, parallel)
    tp_size, stages = check_tp(cfg, rt, parallel), check_pipeline(cfg, rt, parallel)
    if parallel == "pp+fsdp2":
        raise LaunchError(f"--plan --parallel pp+fsdp2 (--pp-stages {cfg.pp_stages}): dist_optim.plan plans one "
                          "pipeline stage per rank (--parallel pp), not stages sharded with FSDP2")
    if parallel not in ("none", "ddp", "fsdp2") and cfg.accumulation_steps > 1:
        raise LaunchError(f"--plan --accumulation-steps {cfg.accumulation_steps} with --parallel {parallel}: "
                          "dist_optim.plan plans accumulation on one process, DDP and FSDP2 (not validated here)")
    if stages:  # each pipeline takes its part of the global batch, which the schedule splits
        micro = cfg.microbatches or MICROBATCHES
        rows = cfg.batch_size // (world // stages) // micro
    else:
        _, dp_size = batch_split(cfg, rt, parallel, tp_size)  # the run's own check
        micro = cfg.accumulation_steps
        rows = cfg.batch_size // (dp_size * micro)
    return PlannedJob(parallel, world, source, tp_size, stages, (rows, cfg.block_size), micro)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules the trainer ``fully_shard``-s before the root."""
    return list(model.blocks)


def _logits_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    if hasattr(logits, "to_local"):  # tensor parallel's replicated logits: the trainer unwraps them (a view)
        logits = logits.to_local()
    return loss_fn(logits, batch[1])


def plan_arguments(cfg: TrainConfig, job: PlannedJob) -> dict[str, Any]:
    """``dist_optim.plan``'s arguments for ``job``: the trainer's model, batch, loss, optimizer and layout."""
    shape = job.micro_batch

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, VOCAB_SIZE, shape), torch.randint(0, VOCAB_SIZE, shape)

    loss: Callable[..., torch.Tensor] = loss_fn if job.stages else _logits_loss
    layout: dict[str, Any] = {"parallel": job.parallel, "world_size": job.stages or job.world}
    if job.parallel in ("fsdp2", "fsdp2+tp"):
        layout["fsdp_units"] = _blocks
    if job.parallel in TENSOR_PARALLEL:
        layout["parallelize"] = tensor_parallel
    if job.parallel == "fsdp2+tp":
        layout["tp_size"] = job.tp_size
    if job.stages:
        layout.update(n_microbatches=job.micro_batches, pp_schedule=cfg.pp_schedule or SCHEDULE,
                      pp_stage_fn=gpt_stage)
    if job.parallel != "none":  # the run's backend (launch.runtime.start): NCCL on CUDA, where gloo's buffers are not
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        layout["backend"] = "nccl" if cuda else "gloo"
    return dict(model_fn=lambda: from_config(cfg.to_dict(), VOCAB_SIZE), batch_fn=batch, loss_fn=loss,
                optimizer_class=optimizer_class(cfg.optimizer), bucket_cap_mb=cfg.bucket_cap_mb,
                accumulation_steps=1 if job.stages else job.micro_batches, max_grad_norm=cfg.max_grad_norm,
                clip_mode=cfg.clip_mode, track_grad_norm=cfg.track_grad_norm, **layout,
                autocast_dtype=None if cfg.autocast is None else getattr(torch, cfg.autocast),
                **optimizer_kwargs(cfg.optimizer, cfg, torch.device("cpu")))


def plan_memory(cfg: TrainConfig) -> dist_optim.MemoryPlan:
    """Plan ``cfg``'s job for one rank; prints the table, writes RUN_DIR/plan.json (and plan.png)."""
    job = planned_job(cfg)
    try:
        plan = dist_optim.plan(**plan_arguments(cfg, job))
    except (ValueError, NotImplementedError) as e:
        raise LaunchError(f"--plan cannot plan --parallel {job.parallel} on {job.world} process(es) with these "
                          f"flags: {' '.join(str(e).split())}") from e
    plan.options.update(micro_batch=list(job.micro_batch), micro_batches_per_step=job.micro_batches,
                        batch_size=cfg.batch_size, world_from=job.world_from, optimizer=cfg.optimizer,
                        **{k: getattr(cfg, k) for k in MODEL_SHAPE})
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(timeline=True)) + "\n")
    written = [str(run_dir / "plan.json")]
    try:
        plan.plot(str(run_dir / "plan.png"))
        written.append(str(run_dir / "plan.png"))
    except ImportError:
        pass
    print(job.describe())
    print(plan.table())
    print(f"written: {', '.join(written)}")
    return plan

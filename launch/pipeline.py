"""``--parallel pp``: the GPT cut into pipeline stages on block boundaries, one stage per rank, and its schedule.

The first stage embeds, the last holds the final norm, the head and (through the schedule's ``loss_fn``) the loss.
A stage keeps the whole model's parameter names (``blocks.3.attn.qkv.weight``), so its checkpoint, saved over a
process group of its own rank, names what the unsplit model names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .gpt import GPT, loss_fn
from .runtime import LaunchError, Runtime

__all__ = ["GPTStage", "Pipeline", "build_pipeline", "check_pipeline", "run_schedule", "stage_blocks", "stage_group"]

MICROBATCHES = 4  # --microbatches none
SCHEDULE = "1f1b"  # --pp-schedule none
PP_OPTIONS = ("pp_stages", "microbatches", "pp_schedule")


class GPTStage(nn.Module):
    """Blocks ``lo`` to ``hi - 1`` of ``gpt`` (shared, not copied), with its embeddings when ``first`` and its
    final norm and head when ``last``."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        # a ModuleDict keyed by the block's index in the whole model: the names stay "blocks.{i}...."
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def stage_blocks(n_layer: int, n_stages: int, stage: int) -> tuple[int, int]:
    """The blocks ``[lo, hi)`` of ``stage``: as even as the count allows, the extra ones on the first stages."""
    base, extra = divmod(n_layer, n_stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (stage < extra)


def check_pipeline(cfg: Any, rt: Runtime, parallel: str) -> int:
    """The number of stages (0 when ``parallel`` is not ``pp``), or a LaunchError naming the setting that the run
    cannot take."""
    if parallel != "pp":
        given = [f"--{k.replace('_', '-')}" for k in PP_OPTIONS if getattr(cfg, k) is not None]
        if given:
            raise LaunchError(f"{', '.join(given)} only apply to --parallel pp, and this run is --parallel {parallel}; "
                              "drop them or use --parallel pp")
        return 0
    stages = cfg.pp_stages or rt.world
    if stages != rt.world:
        raise LaunchError(f"--pp-stages must equal the number of processes ({rt.world}): GPipe and 1F1B run one "
                          f"stage per rank; got {stages}")
    if cfg.n_layer < stages:
        raise LaunchError(f"--parallel pp cuts the model on block boundaries: --n-layer {cfg.n_layer} gives fewer "
                          f"blocks than the {stages} stages; raise --n-layer or lower --pp-stages")
    if cfg.tie_weights and stages > 1:
        raise LaunchError("--parallel pp needs --tie-weights false: the embedding (first stage) and the head (last "
                          "stage) live on different ranks and cannot share one matrix")
    if cfg.accumulation_steps != 1:
        raise LaunchError(f"--accumulation-steps {cfg.accumulation_steps} with --parallel pp: the schedule's "
                          "micro-batches are the accumulation; use --microbatches")
    n = cfg.microbatches or MICROBATCHES
    if cfg.batch_size % n:
        raise LaunchError(f"batch_size must be a multiple of --microbatches {n} (the schedule splits the batch into "
                          f"equal micro-batches), got {cfg.batch_size}")
    if cfg.max_grad_norm is not None and cfg.clip_mode != "per_parameter":
        raise LaunchError(f"--clip-mode {cfg.clip_mode} with --parallel pp: the norm spans every stage, which no "
                          "stage knows when it steps in its last backward (docs/distributed.md, pipeline); use "
                          "--clip-mode per_parameter")
    return stages


def stage_group(rt: Runtime) -> Any:
    """A process group of this rank alone, over which its stage's checkpoint is saved and loaded. Collective:
    every rank creates every rank's group, in the same order, as ``new_group`` needs."""
    return [dist.new_group([r]) for r in range(rt.world)][rt.rank]


@dataclass
class Pipeline:
    module: GPTStage  # this rank's stage: what the optimizer steps and the checkpoint saves
    schedule: Any  # the torch.distributed.pipelining schedule over it
    first: bool  # reads the batch's inputs
    last: bool  # reads the targets and computes the loss


def build_pipeline(gpt: GPT, cfg: Any, rt: Runtime) -> Pipeline:
    """This rank's stage of ``gpt`` (built whole on every rank from the same seed) and its schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    n_stages = check_pipeline(cfg, rt, "pp")
    lo, hi = stage_blocks(cfg.n_layer, n_stages, rt.rank)
    first, last = rt.rank == 0, rt.rank == n_stages - 1
    module = GPTStage(gpt, lo, hi, first, last).to(rt.device)
    stage = PipelineStage(module, rt.rank, n_stages, rt.device)
    cls = Schedule1F1B if (cfg.pp_schedule or SCHEDULE) == "1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=cfg.microbatches or MICROBATCHES, loss_fn=loss_fn)
    return Pipeline(module, schedule, first, last)


def run_schedule(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, last_rank: int) -> torch.Tensor:
    """One ``schedule.step`` over the global batch; the mean micro-batch loss, the same 0-d tensor on every rank.
    Collective."""
    losses: list[torch.Tensor] = []
    args = (x,) if pipe.first else ()
    kwargs = {"target": y, "losses": losses} if pipe.last else {}
    pipe.schedule.step(*args, **kwargs)
    total = torch.zeros((), device=x.device)
    for loss in losses:
        total += loss.detach()
    total /= len(losses) if losses else 1
    if dist.is_initialized():
        dist.broadcast(total, src=last_rank)
    return total

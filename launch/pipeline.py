"""``--parallel pp`` and ``pp+fsdp2``: the GPT cut into pipeline stages on block boundaries, and its schedule.

The first stage embeds, the last holds the final norm, the head and (through the schedule's ``loss_fn``) the loss.
``pp`` runs one stage per rank; ``pp+fsdp2`` runs each stage on ``world / stages`` ranks, ``fully_shard``-ed over
them (pp-major, as ``init_device_mesh`` lays out ``("pp", "dp")``). A stage keeps the whole model's parameter names
(``blocks.3.attn.qkv.weight``), so its checkpoint, saved over the stage's ranks, names what the unsplit model names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .gpt import GPT, loss_fn, run_block
from .runtime import LaunchError, Runtime

__all__ = ["PIPELINED", "GPTStage", "Pipeline", "build_pipeline", "check_pipeline", "gpt_stage", "run_schedule",
           "stage_blocks", "stage_group", "stage_of"]

PIPELINED = ("pp", "pp+fsdp2")  # the --parallel values that run a schedule
MICROBATCHES = 4  # --microbatches none
SCHEDULE = "1f1b"  # --pp-schedule none
PP_OPTIONS = ("pp_stages", "microbatches", "pp_schedule")


class GPTStage(nn.Module):
    """Blocks ``lo`` to ``hi - 1`` of ``gpt`` (shared, not copied), with its embeddings when ``first`` and its
    final norm and head when ``last``."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.checkpoint_blocks = gpt.checkpoint_blocks  # counted in the whole model's blocks
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
        for i, block in self.blocks.items():
            x = run_block(block, x, int(i) < self.checkpoint_blocks)
        return self.head(self.ln_f(x)) if self.last else x


def stage_blocks(n_layer: int, n_stages: int, stage: int) -> tuple[int, int]:
    """The blocks ``[lo, hi)`` of ``stage``: as even as the count allows, the extra ones on the first stages."""
    base, extra = divmod(n_layer, n_stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (stage < extra)


def gpt_stage(gpt: GPT, stage: int, n_stages: int) -> GPTStage:
    """Stage ``stage`` of ``n_stages`` of ``gpt``, as the trainer cuts it (``dist_optim.plan``'s ``pp_stage_fn``)."""
    lo, hi = stage_blocks(len(gpt.blocks), n_stages, stage)
    return GPTStage(gpt, lo, hi, stage == 0, stage == n_stages - 1)


def check_pipeline(cfg: Any, rt: Runtime, parallel: str) -> int:
    """The number of stages (0 when ``parallel`` runs no pipeline), or a LaunchError naming the setting that the
    run cannot take."""
    if parallel not in PIPELINED:
        given = [f"--{k.replace('_', '-')}" for k in PP_OPTIONS if getattr(cfg, k) is not None]
        if given:
            raise LaunchError(f"{', '.join(given)} only apply to --parallel pp or pp+fsdp2, and this run is "
                              f"--parallel {parallel}; drop them or use --parallel pp")
        return 0
    name = f"--parallel {parallel}"
    if parallel == "pp":
        stages = cfg.pp_stages or rt.world
        if stages != rt.world:
            raise LaunchError(f"--pp-stages must equal the number of processes ({rt.world}): GPipe and 1F1B run one "
                              f"stage per rank; got {stages}")
    else:
        stages = cfg.pp_stages
        if stages is None:
            raise LaunchError(f"--parallel pp+fsdp2 needs --pp-stages S: the {rt.world} processes form S stages, each "
                              "fully_shard-ed over world / S of them")
        if rt.world % stages:
            raise LaunchError(f"--pp-stages {stages} must divide the number of processes ({rt.world}) under "
                              "--parallel pp+fsdp2: each stage is sharded over world / S ranks")
        if stages == rt.world:
            raise LaunchError(f"--parallel pp+fsdp2 with --pp-stages {stages} on {rt.world} processes leaves one "
                              "rank per stage, with nothing to shard over; use --parallel pp, or more processes")
    if cfg.n_layer < stages:
        raise LaunchError(f"{name} cuts the model on block boundaries: --n-layer {cfg.n_layer} gives fewer "
                          f"blocks than the {stages} stages; raise --n-layer or lower --pp-stages")
    if cfg.tie_weights and stages > 1:
        raise LaunchError(f"{name} needs --tie-weights false: the embedding (first stage) and the head (last "
                          "stage) live on different ranks and cannot share one matrix")
    if cfg.accumulation_steps != 1:
        raise LaunchError(f"--accumulation-steps {cfg.accumulation_steps} with {name}: the schedule's "
                          "micro-batches are the accumulation; use --microbatches")
    n, replicas = cfg.microbatches or MICROBATCHES, rt.world // stages
    if cfg.batch_size % (n * replicas):
        split = "" if replicas == 1 else f" x the {replicas} ranks per stage (each takes its own part)"
        raise LaunchError(f"batch_size must be a multiple of --microbatches {n}{split}: the schedule splits the "
                          f"batch into equal micro-batches; got {cfg.batch_size}")
    if cfg.max_grad_norm is not None and cfg.clip_mode != "per_parameter":
        raise LaunchError(f"--clip-mode {cfg.clip_mode} with {name}: the norm spans every stage, which no "
                          "stage knows when it steps in its last backward (docs/distributed.md, pipeline); use "
                          "--clip-mode per_parameter")
    return stages


def stage_of(rt: Runtime, stages: int) -> tuple[int, int]:
    """(this rank's stage, its index among the stage's ranks): pp-major, ranks ``[0, world / stages)`` hold stage
    0, as ``init_device_mesh(..., (stages, world // stages))`` lays them out."""
    return divmod(rt.rank, rt.world // stages)


def stage_group(rt: Runtime, stages: int) -> Any:
    """The process group of this rank's stage (under ``pp`` the rank alone), over which the stage's checkpoint is
    saved and loaded. Collective: every rank creates every stage's group, in the same order, as ``new_group``
    needs."""
    per_stage = rt.world // stages
    return [dist.new_group(list(range(s * per_stage, (s + 1) * per_stage))) for s in range(stages)][
        stage_of(rt, stages)[0]]


@dataclass
class Pipeline:
    module: GPTStage  # this rank's stage: what the optimizer steps and the checkpoint saves
    schedule: Any  # the torch.distributed.pipelining schedule over it
    first: bool  # reads the batch's inputs
    last: bool  # reads the targets and computes the loss
    replica: int  # which part of the global batch this rank's pipeline takes
    replicas: int  # ranks per stage (1 under pp): the global batch is cut into that many parts
    pp_group: Any  # the ranks of this rank's pipeline, one per stage (None: the default group)


def build_pipeline(gpt: GPT, cfg: Any, rt: Runtime, parallel: str) -> Pipeline:
    """This rank's stage of ``gpt`` (built whole on every rank from the same seed), sharded under ``pp+fsdp2``, and
    its schedule. Collective."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    n_stages = check_pipeline(cfg, rt, parallel)
    index, replica = stage_of(rt, n_stages)
    replicas = rt.world // n_stages
    first, last = index == 0, index == n_stages - 1
    module = gpt_stage(gpt, index, n_stages).to(rt.device)
    pp_group = None
    if parallel == "pp+fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(rt.device.type, (n_stages, replicas), mesh_dim_names=("pp", "dp"))
        for block in module.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        # the root too: pipeline_optimizers needs the stage fully_shard-ed at its root (embeddings, head)
        fully_shard(module, mesh=mesh["dp"])
        pp_group = mesh["pp"].get_group()
    stage = PipelineStage(module, index, n_stages, rt.device, group=pp_group)
    cls = Schedule1F1B if (cfg.pp_schedule or SCHEDULE) == "1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=cfg.microbatches or MICROBATCHES, loss_fn=loss_fn)
    return Pipeline(module, schedule, first, last, replica, replicas, pp_group)


def run_schedule(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One ``schedule.step`` over this pipeline's part of the global batch; the mean micro-batch loss over every
    replica of the last stage, the same 0-d tensor on every rank. Collective."""
    losses: list[torch.Tensor] = []
    args = (x,) if pipe.first else ()
    kwargs = {"target": y, "losses": losses} if pipe.last else {}
    pipe.schedule.step(*args, **kwargs)
    total = torch.zeros((), device=x.device)
    for loss in losses:
        total += loss.detach()
    total /= len(losses) if losses else 1
    if dist.is_initialized():
        # only the last stage's ranks hold a loss, the others add zeros, which leaves the sum exact
        dist.all_reduce(total)
        total /= pipe.replicas
    return total

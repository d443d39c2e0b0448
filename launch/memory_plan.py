"""``launch.train --plan``: the job's memory planned on fake tensors (``dist_optim.plan``) instead of trained.

The same model, micro-batch, AdamW options, bucket cap, clipping and accumulation as the run would use, one warm
step of each loop; the table is printed, RUN_DIR/plan.json (and plan.png, with matplotlib) written. One process:
a world size and a wrapper are refused until the planner's fake process group is validated against measurement.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

import dist_optim

from .corpus import VOCAB_SIZE
from .gpt import from_config, loss_fn
from .optimizers import OPTIMIZERS, optimizer_class, optimizer_kwargs
from .runtime import LaunchError
from .train_config import TrainConfig

__all__ = ["plan_memory"]


def plan_memory(cfg: TrainConfig) -> dist_optim.MemoryPlan:
    """Plan ``cfg``'s job on one process; prints the table, writes RUN_DIR/plan.json (and plan.png)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or cfg.parallel not in ("auto", "none"):
        raise LaunchError(f"--plan plans one process (--parallel none, no torchrun), got --parallel {cfg.parallel} "
                          f"on {world} process(es): the planner's DDP and FSDP2 are not validated yet")
    if cfg.compare:
        raise LaunchError("--plan and --compare: the one plans both loops, the other runs them; choose one")
    if OPTIMIZERS[cfg.optimizer].matrices is not None:
        raise LaunchError(f"--plan plans one optimizer class over the model; --optimizer {cfg.optimizer} trains "
                          "param groups of two (Muon and AdamW), which the planner does not take")
    if cfg.batch_size % cfg.accumulation_steps:
        raise LaunchError(f"batch_size must be a multiple of world size x accumulation_steps = 1 x "
                          f"{cfg.accumulation_steps}, got {cfg.batch_size}")
    shape = (cfg.batch_size // cfg.accumulation_steps, cfg.block_size)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, VOCAB_SIZE, shape), torch.randint(0, VOCAB_SIZE, shape)

    plan = dist_optim.plan(
        lambda: from_config(cfg.to_dict(), VOCAB_SIZE), batch, lambda model, b: loss_fn(model(b[0]), b[1]),
        optimizer_class(cfg.optimizer), bucket_cap_mb=cfg.bucket_cap_mb, accumulation_steps=cfg.accumulation_steps,
        max_grad_norm=cfg.max_grad_norm, clip_mode=cfg.clip_mode, track_grad_norm=cfg.track_grad_norm,
        **optimizer_kwargs(cfg.optimizer, cfg, torch.device("cpu")),
    )
    plan.options.update(micro_batch=list(shape), **{k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd",
                                                                              "block_size", "tie_weights")})
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(timeline=True)) + "\n")
    written = [str(run_dir / "plan.json")]
    try:
        plan.plot(str(run_dir / "plan.png"))
        written.append(str(run_dir / "plan.png"))
    except ImportError:
        pass
    print(plan.table())
    print(f"written: {', '.join(written)}")
    return plan

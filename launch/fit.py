"""``launch.train --fit --memory MEM``: the trainer's own job searched for the settings that fit ``MEM`` per process
(``dist_optim.fit_settings``), each planned exactly as ``--plan`` plans it (``launch.memory_plan``), and the flags of
the best written out, so that a script runs what was chosen (``--json FILE``).

Searched over the world ``--nproc`` (or torchrun's) gives: ``--parallel`` (none alone; ddp, fsdp2, tp and fsdp2+tp
over several), ``--accumulation-steps`` (the divisors of each rank's share of ``--batch-size``; one process, DDP
and FSDP2, as ``--plan`` plans accumulation), ``--checkpoint-blocks`` (none, half, all), ``--clip-mode`` (two_pass
or exact, with ``--max-grad-norm``), and with ``--allow``: ``--param-dtype bfloat16``, ``--autocast bfloat16``,
``--optimizer adamw8bit/adamw4bit`` (for adamw, with torchao installed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
from typing import Any

import torch

import dist_optim

from .corpus import VOCAB_SIZE
from .gpt import from_config
from .memory_plan import plan_arguments, planned_job
from .runtime import LaunchError
from .train_config import TrainConfig

__all__ = ["fit_job"]

NO_FIT = 3  # the exit code when nothing fits
# flags of the search itself, never part of a candidate's command line
_SEARCH_FLAGS = ("fit", "memory", "json", "allow", "nproc", "plan", "compare", "parallel", "tp_size",
                 "accumulation_steps", "checkpoint_blocks", "param_dtype", "autocast", "clip_mode", "optimizer")
_LOW_BIT = {"8bit": "adamw8bit", "4bit": "adamw4bit"}


def _world(cfg: TrainConfig) -> int:
    return int(os.environ.get("WORLD_SIZE", "0")) or cfg.nproc or 1


def settings(cfg: TrainConfig, allow: tuple[str, ...]) -> tuple[list[dist_optim.FitSetting], list[str]]:
    """Every setting of the trainer's job that the world and the batch allow, and the layouts left out (why)."""
    world = _world(cfg)
    layouts: list[tuple[str, int | None]] = [("none", None)] if world == 1 else \
        [("ddp", None), ("fsdp2", None), ("tp", None)] + [("fsdp2+tp", t) for t in range(2, world) if world % t == 0]
    dtypes = [("float32", None)] + [("bfloat16", None)] * ("bf16-params" in allow) + \
        [("float32", "bfloat16")] * ("autocast" in allow)
    states = ["full"]
    if "low-bit-states" in allow and cfg.optimizer == "adamw" and importlib.util.find_spec("torchao"):
        states += list(_LOW_BIT)
    clips = [None] if cfg.max_grad_norm is None else ["two_pass", "exact"]
    blocks = sorted({0, cfg.n_layer // 2, cfg.n_layer})
    out, skipped = [], []
    for parallel, tp in layouts:
        replicas = 1 if parallel == "tp" else world // (tp or 1)
        why = _refused(cfg, parallel, tp, world)
        if why:
            skipped.append(f"--parallel {parallel}{f' --tp-size {tp}' if tp else ''}: {why}")
            continue
        per = cfg.batch_size // replicas
        steps = [a for a in range(1, per + 1) if per % a == 0] if parallel in ("none", "ddp", "fsdp2") else [1]
        for acc in steps:
            for k in blocks:
                for (dtype, autocast) in dtypes:
                    for state in states:
                        for clip in clips:
                            out.append(dist_optim.FitSetting(parallel, world, tp, None, per // acc, acc, k, dtype,
                                                             autocast, state, clip, cfg.bucket_cap_mb))
    return out, skipped


def _refused(cfg: TrainConfig, parallel: str, tp: int | None, world: int) -> str | None:
    """Why the run refuses this layout (the model's shape does not split over its ranks, say), or None."""
    c = dataclasses.replace(cfg, fit=False, parallel=parallel, tp_size=tp, accumulation_steps=1)
    try:
        planned_job(c, {"WORLD_SIZE": str(world)})
    except LaunchError as e:
        return str(e)
    return None


def _config(cfg: TrainConfig, s: dist_optim.FitSetting) -> TrainConfig:
    return dataclasses.replace(cfg, fit=False, parallel=s.parallel, tp_size=s.tp_size,
                               accumulation_steps=s.accumulation_steps, checkpoint_blocks=s.checkpoint_blocks,
                               param_dtype=s.param_dtype, autocast=s.autocast,
                               clip_mode=s.clip_mode or cfg.clip_mode,
                               optimizer=_LOW_BIT.get(s.state, cfg.optimizer))


def argv(cfg: TrainConfig, s: dist_optim.FitSetting) -> list[str]:
    """``launch.train``'s flags for ``s``: the setting's, then every other option that is not its default."""
    c = _config(cfg, s)
    out = ["--parallel", c.parallel] + (["--tp-size", str(c.tp_size)] if c.tp_size else [])
    out += ["--accumulation-steps", str(c.accumulation_steps), "--checkpoint-blocks", str(c.checkpoint_blocks),
            "--param-dtype", c.param_dtype, "--optimizer", c.optimizer]
    out += (["--autocast", c.autocast] if c.autocast else []) + (["--clip-mode", c.clip_mode] if s.clip_mode else [])
    for f in dataclasses.fields(TrainConfig):
        value = getattr(c, f.name)
        if f.name not in _SEARCH_FLAGS and value != f.default:
            out += [f"--{f.name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def fit_job(cfg: TrainConfig) -> int:
    """Search, print the table and the best command, write ``--json``; the exit code (0, or 3: nothing fits)."""
    if not cfg.memory:
        raise LaunchError("--fit needs --memory MEM, the budget per process (e.g. 80GiB, 512MiB)")
    allow = tuple(a for a in cfg.allow.split(",") if a)
    unknown = [a for a in allow if a not in ("bf16-params", "autocast", "low-bit-states")]
    if unknown:
        raise LaunchError(f"--allow {cfg.allow}: {', '.join(unknown)} unknown; the names are bf16-params, autocast, "
                          "low-bit-states")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in from_config(cfg.to_dict(), VOCAB_SIZE).parameters())
    world = _world(cfg)
    shards = {"none": 1, "ddp": 1}

    def plan_for(s: dist_optim.FitSetting, depth: int | None = None) -> dict[str, Any]:
        c = _config(cfg, s)
        if depth is not None:  # a shallow GPT of the same width: fit extrapolates to --n-layer
            c = dataclasses.replace(c, n_layer=depth)
        return plan_arguments(c, planned_job(c, {"WORLD_SIZE": str(world)}))

    def params_bytes(s: dist_optim.FitSetting) -> int:
        return n_params * (2 if s.param_dtype == "bfloat16" else 4) // shards.get(s.parallel, world)
    candidates, skipped = settings(cfg, allow)
    if not candidates:
        raise LaunchError(f"--fit: no layout of {world} processes runs this job: {'; '.join(skipped)}")
    try:
        result = dist_optim.fit_settings(candidates, plan_for, memory=cfg.memory, params_bytes=params_bytes,
                                         argv_for=lambda s: argv(cfg, s), blocks=cfg.n_layer)
    except (ValueError, NotImplementedError) as e:
        raise LaunchError(f"--fit: {' '.join(str(e).split())}") from e
    result.skipped = skipped
    print(result.table())
    launcher = "python" if world == 1 else f"torchrun --nproc-per-node {world}"
    if result.fits:
        print(f"run: {launcher} -m launch.train {' '.join(result.best.argv)}")
    if cfg.json:
        pathlib.Path(cfg.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"written: {cfg.json}")
    if not result.fits:
        print(f"launch.train: nothing fits --memory {cfg.memory}: the smallest candidate plans "
              f"{result.smallest_peak_bytes / 2**20:.1f} MiB, a budget of "
              f"{result.smallest_budget_bytes() / 2**20:.1f} MiB with the headroom", file=sys.stderr)
        return NO_FIT
    return 0

"""One training job: the model, its optimizer (in backward, or the standard loop), the LR schedule, and one
optimizer step over the step's micro-batches, with clipping and the gradient norm.

Both optimizer modes do the same arithmetic: the same ``--optimizer`` class and options (fused AdamW by default),
the same clipping formula, the same lr per step, so their losses are bitwise equal where the wrapper reduces in the
same order and the class steps each tensor on its own (checked by ``--compare``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

import dist_optim

from .corpus import VOCAB_SIZE, Corpus
from .gpt import from_config, loss_fn
from .memory_peak import PHASE
from .optimizers import (
    check_parallel,
    optimizer_class,
    optimizer_kwargs,
    param_groups,
    standard_optimizer,
)
from .pipeline import PIPELINED, build_pipeline, run_schedule
from .runtime import LaunchError, Runtime
from .tensor_parallel import batch_split, check_tp, data_parallel
from .train_config import TrainConfig
from .wrapping import sync_context, wrap

__all__ = ["Job", "StepResult"]


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """lr factor: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens: int
    seconds: float
    # per rank, in rank order: the gradient bytes alive at once in the step (in backward: opt.last_step's peak; the
    # standard loop: every gradient, as opt.step() reads them), and the memory peak (CUDA: the allocator's peak in
    # the step; CPU: the process's resident high-water mark so far, VmHWM)
    grad_bytes_peak: list[int] | None = None
    memory_peak_bytes: list[int] | None = None


def _across_stages(norm: torch.Tensor, group) -> torch.Tensor:
    """The model's 2-norm from each stage's (a collective over ``group``, one rank per stage)."""
    square = norm.detach().square()
    torch.distributed.all_reduce(square, group=group)
    return square.sqrt()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Job:
    """A model and optimizer built from ``cfg`` (same seed, same initial model on every rank and in every mode)."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, corpus: Corpus, parallel: str, mode: str) -> None:
        tp_size = check_tp(cfg, rt, parallel)
        # the TP ranks of a replica share its batch: the global batch is split over the replicas only
        if parallel in PIPELINED:  # a pipeline's schedule splits its batch itself
            self.dp_rank, self.dp_size = data_parallel(rt, parallel, tp_size)
        else:
            self.dp_rank, self.dp_size = batch_split(cfg, rt, parallel, tp_size)
        self.cfg, self.rt, self.corpus, self.parallel, self.mode = cfg, rt, corpus, parallel, mode
        check_parallel(cfg.optimizer, parallel)
        if cfg.autocast is not None and parallel in PIPELINED:
            raise LaunchError(f"--autocast {cfg.autocast} with --parallel {parallel}: the pipeline's schedule runs the "
                              "stages' forwards itself, outside the trainer's autocast; drop --autocast or use "
                              "--param-dtype bfloat16")
        torch.manual_seed(cfg.seed)
        model = from_config(cfg.to_dict(), VOCAB_SIZE)
        self.n_params = sum(p.numel() for p in model.parameters())
        # --parallel pp, pp+fsdp2: every rank builds the whole model (the same initial weights) and keeps its stage
        self.pipe = build_pipeline(model, cfg, rt, parallel) if parallel in PIPELINED else None
        self.model = self.pipe.module if self.pipe is not None else wrap(model, parallel, rt, tp_size)
        cls = optimizer_class(cfg.optimizer)
        options = optimizer_kwargs(cfg.optimizer, cfg, rt.device)
        if mode == "in_backward" and self.pipe is not None:
            clip = {"max_grad_norm": cfg.max_grad_norm, "clip_mode": cfg.clip_mode} if cfg.max_grad_norm else {}
            try:
                (self.opt,) = dist_optim.pipeline_optimizers(
                    self.pipe.schedule, cls, bucket_cap_mb=cfg.bucket_cap_mb,
                    track_grad_norm=cfg.track_grad_norm, **clip, **options,
                )
            except (ValueError, NotImplementedError) as e:
                raise LaunchError(f"dist_optim refuses this setting: {e}") from e
        elif mode == "in_backward":
            groups = param_groups(cfg.optimizer, self.model, cfg)  # --optimizer muon: Muon's group and AdamW's
            try:
                self.opt = dist_optim.InBackwardOptimizer(
                    self.model if groups is None else groups, cls,
                    bucket_cap_mb=cfg.bucket_cap_mb,
                    # wrappers accumulate through their own no-sync switch, TP alone through opt.no_step() (below),
                    # one process through the engine's count
                    accumulation_steps=cfg.accumulation_steps if parallel == "none" else 1,
                    max_grad_norm=cfg.max_grad_norm, clip_mode=cfg.clip_mode,
                    track_grad_norm=cfg.track_grad_norm,
                    # the norm over the model's parameters in their order, as the standard loop takes it
                    grad_norm_order=None if groups is None else list(self.model.parameters()), **options,
                )
            except (ValueError, NotImplementedError, RuntimeError) as e:
                raise LaunchError(f"dist_optim refuses this setting: {e}") from e
        else:
            self.opt = standard_optimizer(cfg.optimizer, self.model, cfg, rt.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            # a partial has no state for LambdaLR to save: the schedule comes from the config, also on resume
            self.opt, functools.partial(warmup_cosine, warmup=cfg.warmup_steps, total=cfg.steps,
                                        min_ratio=cfg.min_lr_ratio)
        )
        self._previous_norm: torch.Tensor | None = None

    def apply_options(self) -> None:
        """After a resume: the optimizer's hyperparameters from this run's options, not the checkpoint's (a load
        restores ``lr``, ``betas``, ``weight_decay`` and the scheduler's ``base_lrs`` as they were saved); the lr of
        the resumed step as LambdaLR computes it. Unchanged options give the same values, bit for bit."""
        cfg = self.cfg
        self.sched.base_lrs = [cfg.lr for _ in self.opt.param_groups]
        for group, fn in zip(self.opt.param_groups, self.sched.lr_lambdas):
            lr = cfg.lr * fn(self.sched.last_epoch)
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr in a tensor its compiled step reads
                group["lr"].fill_(lr)
                lr = group["lr"]
            group.update(initial_lr=cfg.lr, lr=lr, weight_decay=cfg.weight_decay)
            if "betas" in group:  # not Muon's (--optimizer muon), whose momentum is its own default
                group["betas"] = (cfg.beta1, cfg.beta2)

    def extra_state(self) -> dict:
        """What a checkpoint needs besides the model, optimizer and schedule: the standard loop's previous gradient
        norm (``--clip-mode previous_norm``; the in-backward optimizer keeps its own in its state)."""
        norm = self._previous_norm
        return {"previous_norm": None if norm is None else _full(norm).item()}

    def load_extra_state(self, extra: dict) -> None:
        value = extra.get("previous_norm")
        if self.mode == "standard" and value is not None:
            # a float32 norm round trips through a Python float exactly
            self._previous_norm = torch.tensor(value, dtype=torch.float32, device=self.rt.device)

    def step(self, step: int) -> StepResult:
        """One optimizer step: every micro-batch of global batch ``step``, then the step (in backward, or after)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        lr = float(self.opt.param_groups[0]["lr"])
        if self.pipe is not None:
            # each pipeline replica takes its part of the global batch (the whole of it under pp), as fsdp2's ranks
            # do: the first stage reads x, the last y, the schedule splits them into micro-batches
            ((x, y),) = self.corpus.micro_batches(step, cfg.batch_size, self.pipe.replica, self.pipe.replicas, 1)
            total = run_schedule(self.pipe, x.to(self.rt.device), y.to(self.rt.device))
            micro = []
        else:
            micro = self.corpus.micro_batches(step, cfg.batch_size, self.dp_rank, self.dp_size,
                                              cfg.accumulation_steps)
            total = torch.zeros((), device=self.rt.device)
        for j, (x, y) in enumerate(micro):
            x, y = x.to(self.rt.device), y.to(self.rt.device)
            last = j == len(micro) - 1
            # TP alone has no wrapper to hold its gradients back: the in-backward optimizer does (DTensor parameters
            # without FSDP2's no-sync switch cannot be counted by accumulation_steps)
            holds = self.parallel == "tp" and self.mode == "in_backward" and not last
            held = self.opt.no_step() if holds else contextlib.nullcontext()
            with sync_context(self.model, self.parallel, last), held:
                with record_function(PHASE + "forward"), self._autocast():
                    loss = loss_fn(self.model(x), y) / len(micro)
                with record_function(PHASE + "backward"):
                    if self.mode == "in_backward":
                        self.opt.backward(loss)  # the last micro-batch's backward steps AdamW (two_pass: two of them)
                    else:
                        loss.backward()
            total += loss.detach()
        if self.mode == "standard":
            norm = self._clip_standard()
            grad_bytes = _grad_bytes(self.model)
            with record_function(PHASE + "step"):
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            norm = self.opt.grad_norm
            grad_bytes = self.opt.last_step.grad_bytes_peak
        if norm is not None and self.pipe is not None:
            # a sharded stage's norm is a DTensor: its full value first, then summed over one rank per stage
            norm = _across_stages(_full(norm), self.pipe.pp_group)
        self.sched.step()
        loss_value = (total if self.pipe is not None else self.rt.mean(total)).item()
        return StepResult(
            step=step, loss=loss_value, lr=lr,
            grad_norm=None if norm is None else _full(norm).item(),
            tokens=cfg.batch_size * cfg.block_size, seconds=time.perf_counter() - t0,
            **dict(zip(("grad_bytes_peak", "memory_peak_bytes"),
                       map(list, zip(*self.rt.all_gather((int(grad_bytes), _memory_peak(self.rt.device))))))),
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=getattr(torch, self.cfg.autocast))

    def _clip_standard(self) -> torch.Tensor | None:
        """The standard loop's counterpart of the in-backward clipping options (docs/clipping.md), same arithmetic.
        Returns the pre-clipping global norm where in-backward measures one."""
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.grad is not None]
        c, mode = cfg.max_grad_norm, cfg.clip_mode
        norm = None
        if cfg.track_grad_norm or (c is not None and mode != "per_parameter"):
            norm = nn.utils.get_total_norm([p.grad for p in params])
        if c is not None:
            if mode in ("exact", "two_pass"):
                nn.utils.clip_grads_with_norm_(params, c, norm)
            elif mode == "per_parameter":
                for p in params:
                    nn.utils.clip_grad_norm_([p], c)
            elif self._previous_norm is not None:
                nn.utils.clip_grads_with_norm_(params, c, self._previous_norm)
        self._previous_norm = norm
        return norm


def _grad_bytes(model: nn.Module) -> int:
    """The bytes of this rank's gradients alive now (a sharded gradient's local part)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return sum((g.to_local() if hasattr(g, "to_local") else g).nbytes for g in grads)


@functools.cache
def _heap_shim() -> Any:
    """benchmarks/heap_shim.c's peak, when it is preloaded (LD_PRELOAD) into this process; else None."""
    try:
        peak = ctypes.CDLL(None).shim_peak
    except (AttributeError, OSError):
        return None
    peak.restype = ctypes.c_long
    return peak


def _memory_peak(device: torch.device) -> int:
    """CUDA: the allocator's peak since the step began; CPU: with benchmarks/heap_shim.c preloaded, the tensor
    bytes of every thread at their peak since the process began (the run's peak so far), else the process's
    resident high-water mark (VmHWM)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if _heap_shim() is not None:
        return int(_heap_shim()())
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return 0  # not Linux: no figure
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0")
    return int(kib) * 1024

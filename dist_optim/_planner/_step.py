"""What the planner traces and what it returns: one training step of either loop (:class:`Job`, the same step
a validation runs for real) and the plan of its memory (:class:`LoopPlan`, :class:`MemoryPlan`, :func:`loop_plan`).

The one-process and layout planner (``_plan``) and the pipeline planner (``_pipeline``) both build on this module;
it imports neither.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dist_optim._planner._fsdp2 import local
from dist_optim._torch_internals import unset_fake_temporarily
from dist_optim.optimizer import InBackwardOptimizer

__all__: list[str] = []

MiB = 2**20
LOOPS = ("standard", "in_backward")
CATEGORIES = ("parameters", "optimizer_state", "gradients", "activations", "communication", "workspaces", "other")
# What a trace of operators' outputs cannot see, said in the output and docs/planning.md
NOT_SEEN = (
    "memory no operator returns, besides CPU convolutions' (calibrated: workspaces) and what CPU convolutions and "
    "matrix products keep outside torch's allocator (measured, where glibc can be read): kernels' workspaces on "
    "CUDA (cuBLAS, cuDNN), the CUDA caching allocator's rounding and fragmentation, the CUDA context",
)


@dataclass
class LoopPlan:
    """One loop's planned memory through the warm step (bytes, this process)."""

    loop: str  # "standard" or "in_backward"
    peak_bytes: int  # the most bytes alive at once during the step
    start_bytes: int  # alive when the step starts: parameters, optimizer state, buffers, the batch
    breakdown: dict[str, int]  # the peak split by CATEGORIES (sums to peak_bytes)
    peak_phase: str  # the part of the step the peak falls in: forward, backward, step
    kernel: str  # the optimizer kernel the step ran: fused, foreach or for-loop
    timeline: list[tuple[int, str, int]] = field(default_factory=list, repr=False)  # (event, phase, bytes alive)
    # the first step's peak: it creates the optimizer state (lazily, as most classes do), so it is rarely the larger
    first_step_peak_bytes: int = 0
    counts: dict[str, int] = field(default_factory=dict, repr=False)  # fit's cost inputs: flops, collective_bytes

    @property
    def step_peak_bytes(self) -> int:
        """The peak above the step's start: what ``launch.memory_peak.allocator_peak`` measures of a step."""
        return self.peak_bytes - self.start_bytes

    @property
    def run_peak_bytes(self) -> int:
        """The peak of a whole run: the larger of the first step's and a warm step's."""
        return max(self.peak_bytes, self.first_step_peak_bytes)


@dataclass
class MemoryPlan:
    """Both loops' planned memory for one configuration (bytes, this process). ``saving_bytes`` is the standard
    peak minus the in-backward one."""

    standard: LoopPlan
    in_backward: LoopPlan
    n_params: int  # parameters this process holds
    options: dict[str, Any]  # the engine's and the batch's options, as planned
    not_seen: tuple[str, ...] = NOT_SEEN
    # what CPU kernels keep outside torch's allocator (oneDNN, MKL), measured by running them once; not in the peaks;
    # None where not measured (CUDA, no such kernel, no glibc)
    outside_bytes: int | None = None

    @property
    def saving_bytes(self) -> int:
        return self.standard.peak_bytes - self.in_backward.peak_bytes

    def loops(self) -> tuple[LoopPlan, LoopPlan]:
        return self.standard, self.in_backward

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The plan as JSON-ready values (``timeline=True`` adds both loops' timelines)."""
        out: dict[str, Any] = {"n_params": self.n_params, "options": self.options,
                               "saving_bytes": self.saving_bytes, "outside_bytes": self.outside_bytes,
                               "not_seen": list(self.not_seen)}
        for lp in self.loops():
            out[lp.loop] = {"peak_bytes": lp.peak_bytes, "first_step_peak_bytes": lp.first_step_peak_bytes,
                            "run_peak_bytes": lp.run_peak_bytes, "start_bytes": lp.start_bytes,
                            "step_peak_bytes": lp.step_peak_bytes, "breakdown": lp.breakdown,
                            "bytes_per_param": lp.peak_bytes / max(1, self.n_params),
                            "peak_phase": lp.peak_phase, "kernel": lp.kernel,
                            **({"timeline": lp.timeline} if timeline else {})}
        return out

    def table(self) -> str:
        """Both loops side by side, in MiB, with the saving and what the plan does not see."""
        rows = [("", "standard", "in backward")]
        rows.append(("peak (MiB)", *(f"{lp.peak_bytes / MiB:.1f}" for lp in self.loops())))
        if any(lp.first_step_peak_bytes for lp in self.loops()):  # traced (not by the pipeline planner)
            rows.append(("first step's peak", *(f"{lp.first_step_peak_bytes / MiB:.1f}" for lp in self.loops())))
        for c in CATEGORIES:
            rows.append((f"  {c.replace('_', ' ')}", *(f"{lp.breakdown[c] / MiB:.1f}" for lp in self.loops())))
        rows.append(("bytes / parameter", *(f"{lp.peak_bytes / max(1, self.n_params):.2f}" for lp in self.loops())))
        rows.append(("peak during", *(lp.peak_phase for lp in self.loops())))
        rows.append(("optimizer kernel", *(lp.kernel for lp in self.loops())))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[0].ljust(width[0]) if i == 0 else r[i].rjust(width[i]) for i in range(3)) for r in rows]
        saving = self.saving_bytes
        pct = 100 * saving / self.standard.peak_bytes if self.standard.peak_bytes else 0.0
        lines.append(f"saving: {saving / MiB:.1f} MiB ({pct:.1f} % of the standard peak), {self.n_params:,} "
                     f"parameters, {self.options.get('layout', 'one process')}")
        if self.outside_bytes is not None:
            lines.append(f"outside torch's allocator (oneDNN's and MKL's kernels, measured): "
                         f"{self.outside_bytes / MiB:.2f} MiB more than each peak")
        lines += [f"not seen: {why}" for why in self.not_seen]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG of both loops' bytes alive through the warm step, on one scale from 0, and below it the standard
        loop's bytes less the in-backward loop's at each point of the step (where the two curves coincide, the
        difference still shows) (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, diff) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=(3, 1.2))
        curves = []
        for lp, style in zip(self.loops(), ({"ls": "-", "marker": "o"}, {"ls": "--", "marker": "x"})):
            n = max(1, lp.timeline[-1][0])
            xs, ys = [e / n for e, _, _ in lp.timeline], [b / MiB for _, _, b in lp.timeline]
            curves.append((xs, ys))
            ax.plot(xs, ys, lw=1, markevery=max(1, len(xs) // 25), ms=4, **style,
                    label=f"{lp.loop.replace('_', ' ')}: peak {lp.peak_bytes / MiB:.1f} MiB")
        ax.set_xlim(left=0)  # from 0, so that heights and the saving read as proportions
        ax.set_ylim(bottom=0)
        ax.set_ylabel("MiB alive (planned)")
        ax.set_title(f"planned memory, one step; saving {self.saving_bytes / MiB:.1f} MiB")
        ax.legend()
        grid = [i / 400 for i in range(401)]
        diff.plot(grid, [_at(curves[0], x) - _at(curves[1], x) for x in grid], lw=1, color="tab:green")
        diff.axhline(0, color="k", lw=0.5)
        diff.set_xlabel("progress through the warm step (allocation events, each loop's own)")
        diff.set_ylabel("standard - in backward\n(MiB)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _at(curve: tuple[list[float], list[float]], x: float) -> float:
    """The step function ``curve`` (event positions, values) at ``x``: the last value at or before it."""
    import bisect

    xs, ys = curve
    return ys[max(0, bisect.bisect_right(xs, x) - 1)]


# -- the step, the same for planning and for measuring --------------------------------------------------------------
def _default_kernel(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The standard loop's kernel where the caller chose none: fused where the class has it (not SGD, as the
    in-backward engine), else foreach: the same kernel on both sides."""
    if kwargs.get("fused") is not None or kwargs.get("foreach") is not None:
        return {}
    names = inspect.signature(cls.__init__).parameters
    if "fused" in names and not issubclass(cls, torch.optim.SGD):
        return {"fused": True}
    return {"foreach": True} if "foreach" in names else {}


def in_backward_kernel(opt: Any) -> str:
    """The kernel an ``InBackwardOptimizer`` steps with: fused, foreach or for-loop."""
    pairs = list(zip(opt.kernels, opt.param_groups))
    return ("fused" if any(k.get("fused") or g.get("fused") for k, g in pairs) else
            "foreach" if any(k.get("foreach") or g.get("foreach") for k, g in pairs) else "for-loop")


def sync_accumulation(model: nn.Module) -> str | None:
    """How ``model``'s wrapper accumulates over micro-batches: ``"no_sync"`` (DDP: ``with model.no_sync()`` on the
    micro-batches before the last), ``"gradient_sync"`` (FSDP2: ``model.set_requires_gradient_sync(False)`` on
    those), or ``None`` (the gradients accumulate in ``.grad``; in backward, the engine's ``accumulation_steps``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "no_sync"
    from torch.distributed.fsdp import FSDPModule

    return "gradient_sync" if isinstance(model, FSDPModule) else None


class Job:
    """A model, its optimizer in one loop (``"standard"`` or ``"in_backward"``) and one optimizer step over
    micro-batches: what :func:`plan` traces on fake tensors and a validation runs for real. Under DDP and FSDP2 only
    the last micro-batch reduces (``no_sync``, ``set_requires_gradient_sync``: :func:`sync_accumulation`), in both
    loops, as the trainer accumulates; in backward that last backward steps."""

    def __init__(self, model: nn.Module, loop: str, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                 engine_options: dict[str, Any], before_optimizer: Callable[[nn.Module], None] | None = None
                 ) -> None:
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        self.model, self.loop, self.loss_fn = model, loop, loss_fn
        self.max_grad_norm = engine_options.get("max_grad_norm")
        self.clip_mode = engine_options.get("clip_mode", "exact")
        self.accumulation_steps = engine_options.get("accumulation_steps", 1)
        self.track_grad_norm = engine_options.get("track_grad_norm", False)
        self.sync = sync_accumulation(model)
        if self.sync is not None:  # the wrapper's sync accumulates: InBackwardOptimizer steps the reducing backward
            engine_options = {**engine_options, "accumulation_steps": 1}
        self.autocast: torch.dtype | None = None  # the forward's autocast dtype, if any
        if before_optimizer is not None:
            before_optimizer(model)
        self.opt: torch.optim.Optimizer = self._optimizer(optimizer_class, optimizer_kwargs, engine_options)
        self._previous_norm: torch.Tensor | None = None
        self.phase: Callable[[str], None] = lambda name: None  # told where the step is (the planner's trace)

    def _optimizer(self, optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                   engine_options: dict[str, Any]) -> torch.optim.Optimizer:
        """The loop's optimizer over the model (``self.kernel`` set to the kernel it steps with)."""
        if self.loop == "in_backward":
            # the engine probes a class not of torch.optim on real tensors (its RNG positions among them), which a
            # fake mode refuses: built outside it, the fake parameters stay fake
            outside = unset_fake_temporarily() if getattr(optimizer_class, "stands_in", False) else nullcontext()
            with outside:
                opt = InBackwardOptimizer(self.model, optimizer_class, **engine_options, **optimizer_kwargs)
            self.kernel = in_backward_kernel(opt)
            return opt
        kw = {**_default_kernel(optimizer_class, optimizer_kwargs), **optimizer_kwargs}
        self.kernel = "fused" if kw.get("fused") else "foreach" if kw.get("foreach") else "for-loop"
        return optimizer_class([p for p in self.model.parameters() if p.requires_grad], **kw)

    def step(self, batches: Sequence[Any]) -> None:
        """One optimizer step over ``batches`` (its micro-batches, ``accumulation_steps`` of them)."""
        for j, batch in enumerate(batches):
            with self._micro_batch(last=j == len(batches) - 1):
                self.phase("forward")
                if self.autocast is None:
                    loss = self.loss_fn(self.model, batch) / len(batches)
                else:
                    device = next(self.model.parameters()).device.type
                    with torch.autocast(device, dtype=self.autocast):
                        loss = self.loss_fn(self.model, batch) / len(batches)
                self.phase("backward")
                if self.loop == "in_backward":
                    self.opt.backward(loss)
                else:
                    loss.backward()
                del loss
        self._standard_step()

    def _micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The wrapper's accumulation around one micro-batch: only the last one reduces."""
        if self.sync == "no_sync" and not last:
            return self.model.no_sync()  # type: ignore[operator]
        if self.sync == "gradient_sync":
            self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _standard_step(self) -> None:
        """The standard loop's step after its backwards: clipping, ``opt.step()``, ``opt.zero_grad()``."""
        if self.loop == "standard":
            self.phase("step")
            self._clip()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _clip(self) -> None:
        """The standard loop's counterpart of each clip mode (as launch/train_loop.py clips)."""
        c, mode = self.max_grad_norm, self.clip_mode
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = None
        if self.track_grad_norm or (c is not None and mode != "per_parameter"):
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

    def resident(self) -> list[torch.Tensor]:
        """The tensors alive between steps: parameters, buffers, gradients left over, optimizer state."""
        out = [*self.model.parameters(), *self.model.buffers()]
        out += [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in self.opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if self._previous_norm is not None:
            out.append(self._previous_norm)
        return out



# -- the plan of a traced step ---------------------------------------------------------------------------------------
def loop_plan(loop: str, trace: Any, start: int, model: nn.Module, job: Job) -> LoopPlan:
    """A traced loop's plan: its peak split into CATEGORIES (``model``'s parameters and buffers, ``job``'s optimizer
    state, the blocks that were a ``.grad``, those made in the forward, the rest)."""
    # ids of blocks alive now (and so unique): the parameters' and the optimizer state's
    params = {id(trace.block_of(local(t))) for t in [*model.parameters(), *model.buffers()]} - {id(None)}
    state = {id(trace.block_of(local(v))) for s in job.opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)} - {id(None)}
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for block, nbytes in trace.peak_blocks:
        key = id(block)
        category = ("parameters" if key in params else "optimizer_state" if key in state else
                    "communication" if block.is_comm else "workspaces" if block.is_workspace else
                    "gradients" if block.is_grad else
                    "activations" if block.phase == "forward" else "other")
        breakdown[category] += nbytes
    assert sum(breakdown.values()) == trace.peak, (breakdown, trace.peak)
    return LoopPlan(loop, trace.peak, start, breakdown, trace.peak_phase, job.kernel, trace.timeline)

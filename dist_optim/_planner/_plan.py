"""Will it fit? The memory of one training step, planned on fake tensors, for the standard loop and in backward.

:func:`plan` builds the model under ``FakeTensorMode`` (no real memory), runs a first step to create the optimizer
state, then traces the storages of a second, warm step: the peak, split into parameters, optimizer state, gradients,
activations and other, for ``loss.backward(); opt.step(); opt.zero_grad()`` and for ``InBackwardOptimizer``.
One process, or one representative rank of a DDP, FSDP2, TP, FSDP2 x TP or HSDP job (``world_size``, ``parallel``:
``_plan_layouts``, ``_plan_fsdp2``, ``_plan_tp``), or every stage rank of a pipeline (``_plan_pipeline``).
``python -m dist_optim.plan`` does it from the command line (``_plan_cli``); this module is the planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dist_optim._planner._layouts import Layout, check_backend

__all__: list[str] = []

MiB = 2**20
LOOPS = ("standard", "in_backward")
CATEGORIES = ("parameters", "optimizer_state", "gradients", "activations", "communication", "other")
CLIP_MODES = ("exact", "two_pass", "per_parameter", "previous_norm")
# What a trace of operators' outputs cannot see, said in the output and docs/planning.md
NOT_SEEN = (
    "memory no operator returns: kernels' workspaces (cuBLAS, cuDNN, MKL), the CUDA caching allocator's "
    "rounding and fragmentation, the CUDA context",
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

    @property
    def step_peak_bytes(self) -> int:
        """The peak above the step's start: what ``launch.memory_peak.allocator_peak`` measures of a step."""
        return self.peak_bytes - self.start_bytes


@dataclass
class MemoryPlan:
    """Both loops' planned memory for one configuration (bytes, this process). ``saving_bytes`` is the standard
    peak minus the in-backward one."""

    standard: LoopPlan
    in_backward: LoopPlan
    n_params: int  # parameters this process holds
    options: dict[str, Any]  # the engine's and the batch's options, as planned
    not_seen: tuple[str, ...] = NOT_SEEN

    @property
    def saving_bytes(self) -> int:
        return self.standard.peak_bytes - self.in_backward.peak_bytes

    def loops(self) -> tuple[LoopPlan, LoopPlan]:
        return self.standard, self.in_backward

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The plan as JSON-ready values (``timeline=True`` adds both loops' timelines)."""
        out: dict[str, Any] = {"n_params": self.n_params, "options": self.options,
                               "saving_bytes": self.saving_bytes, "not_seen": list(self.not_seen)}
        for lp in self.loops():
            out[lp.loop] = {"peak_bytes": lp.peak_bytes, "start_bytes": lp.start_bytes,
                            "step_peak_bytes": lp.step_peak_bytes, "breakdown": lp.breakdown,
                            "bytes_per_param": lp.peak_bytes / max(1, self.n_params),
                            "peak_phase": lp.peak_phase, "kernel": lp.kernel,
                            **({"timeline": lp.timeline} if timeline else {})}
        return out

    def table(self) -> str:
        """Both loops side by side, in MiB, with the saving and what the plan does not see."""
        rows = [("", "standard", "in backward")]
        rows.append(("peak (MiB)", *(f"{lp.peak_bytes / MiB:.1f}" for lp in self.loops())))
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
        lines += [f"not seen: {why}" for why in self.not_seen]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG of both loops' bytes alive through the warm step (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for lp in self.loops():
            n = max(1, lp.timeline[-1][0])
            ax.plot([e / n for e, _, _ in lp.timeline], [b / MiB for _, _, b in lp.timeline],
                    label=f"{lp.loop.replace('_', ' ')}: peak {lp.peak_bytes / MiB:.1f} MiB", lw=1)
        ax.set_xlabel("progress through the warm step (allocation events)")
        ax.set_ylabel("MiB alive (planned)")
        ax.set_title(f"planned memory, one step; saving {self.saving_bytes / MiB:.1f} MiB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


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
            from dist_optim.optimizer import InBackwardOptimizer

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


# -- planning -------------------------------------------------------------------------------------------------------
def _trace_loop(loop: str, model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
                loss_fn: Callable[[nn.Module, Any], torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                optimizer_kwargs: dict[str, Any], engine_options: dict[str, Any],
                autocast_dtype: torch.dtype | None, layout: Layout, mesh: Any) -> tuple[LoopPlan, int, str]:
    from dist_optim._planner._memory_trace import MemoryTrace
    from dist_optim._planner._fsdp2 import local
    from dist_optim._torch_internals import FakeTensorMode, fsdp_resized_tensors, tree_leaves

    micro = engine_options.get("accumulation_steps", 1)
    with FakeTensorMode(), layout.inside_fake_mode(), warnings.catch_warnings():
        # the engine compares gradients' storage addresses, which fake tensors do not have (0, and a warning):
        # only FSDP2's shared reduce-scatter buffers depend on it
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model = model_fn()
        trace = MemoryTrace(layout.collective_buffers())

        def seen(p: torch.Tensor) -> None:
            block = trace.block_of(local(p.grad))
            if block is not None:
                block.is_grad = True

        def watch(m: nn.Module) -> None:  # before the optimizer's hooks (and DDP's), which may free the gradient
            for p in m.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(seen)
        if not layout.replaces_parameters:
            watch(model)
        model = layout.wrap(model, mesh)
        if layout.replaces_parameters:  # fully_shard or a TP plan replaced the parameters (DTensors)
            watch(model)
        n_params = sum(local(p).numel() for p in model.parameters() if p.requires_grad)  # this rank's
        engine = {**engine_options, **(layout.engine_options() if loop == "in_backward" else {})}
        job = Job(model, loop, loss_fn, optimizer_class, optimizer_kwargs, engine)
        job.autocast = autocast_dtype
        job.step([batch_fn() for _ in range(micro)])  # the first step creates the optimizer state
        batches = [batch_fn() for _ in range(micro)]
        extra: list[torch.Tensor] = []
        if hasattr(model, "bucket_buffers"):  # DDP rebuilds its buckets at the next forward: before the trace
            model.reducer.rebuild()
            extra = model.bucket_buffers()

        def phase(name: str) -> None:
            trace.phase = name
        job.phase = phase
        resident = [local(t) for t in job.resident()] + extra
        with trace:
            if layout.resizes:  # FSDP2's unsharded parameters, allocated and freed by resizing their storages
                trace.follow(fsdp_resized_tensors(model))
            trace.seed(resident + [t for t in tree_leaves(batches) if isinstance(t, torch.Tensor)])
            for t in extra:  # DDP's buckets hold gradients
                trace.block_of(t).is_grad = True
            start = trace.total
            trace.phase = "forward"
            job.step(batches)
            trace.finish()
        device = next(model.parameters()).device.type
        return loop_plan(loop, trace, start, model, job), n_params, device


def loop_plan(loop: str, trace: Any, start: int, model: nn.Module, job: Job) -> LoopPlan:
    """A traced loop's plan: its peak split into CATEGORIES (``model``'s parameters and buffers, ``job``'s optimizer
    state, the blocks that were a ``.grad``, those made in the forward, the rest)."""
    from dist_optim._planner._fsdp2 import local

    # ids of blocks alive now (and so unique): the parameters' and the optimizer state's
    params = {id(trace.block_of(local(t))) for t in [*model.parameters(), *model.buffers()]} - {id(None)}
    state = {id(trace.block_of(local(v))) for s in job.opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)} - {id(None)}
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for block, nbytes in trace.peak_blocks:
        key = id(block)
        category = ("parameters" if key in params else "optimizer_state" if key in state else
                    "communication" if block.is_comm else "gradients" if block.is_grad else
                    "activations" if block.phase == "forward" else "other")
        breakdown[category] += nbytes
    assert sum(breakdown.values()) == trace.peak, (breakdown, trace.peak)
    return LoopPlan(loop, trace.peak, start, breakdown, trace.peak_phase, job.kernel, trace.timeline)


def plan(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    bucket_cap_mb: float = 4.0,
    per_parameter: bool = False,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_mode: str = "exact",
    track_grad_norm: bool = False,
    autocast_dtype: torch.dtype | None = None,
    world_size: int = 1,
    parallel: str = "none",
    ddp_bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = False,
    fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None,
    n_microbatches: int = 4,
    pp_schedule: str = "1F1B",
    pp_stage_fn: Callable[[nn.Module, int, int], nn.Module] | None = None,
    tp_size: int | None = None,
    shard_size: int | None = None,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
    backend: str | None = None,
    **optimizer_kwargs: Any,
) -> MemoryPlan:
    """Plan one warm training step's memory on this process, for the standard loop and in backward, without
    allocating the model.

    Both loops build the model with ``model_fn`` under ``FakeTensorMode`` (tensors with shapes and no data), run one
    step to create the optimizer state, then trace every storage of a second step: the standard loop is
    ``loss.backward()`` per micro-batch, the clipping ``clip_mode`` stands for (``clip_grad_norm_`` for
    ``"exact"`` and ``"two_pass"``), ``opt.step(); opt.zero_grad()``; in backward it is
    ``InBackwardOptimizer(model, optimizer_class, ...)`` and ``opt.backward(loss)``. Both use the same kernel:
    ``fused`` where the class has one, else ``foreach``, unless ``optimizer_kwargs`` choose.

    Args:
        model_fn: builds the model (called under ``FakeTensorMode``; it must not read real tensors).
        batch_fn: makes one micro-batch (called under ``FakeTensorMode``), e.g. ``lambda: (torch.randint(...),) * 2``.
        loss_fn: ``loss_fn(model, batch)``, the micro-batch's loss (the planner divides it by
            ``accumulation_steps``).
        optimizer_class: a ``torch.optim.Optimizer`` subclass.
        bucket_cap_mb, per_parameter, accumulation_steps, max_grad_norm, clip_mode, track_grad_norm: the
            engine's options (see ``InBackwardOptimizer``); the standard loop clips as ``clip_mode`` says. Under
            ``"ddp"`` and ``"fsdp2"`` the micro-batches accumulate as those wrappers do, in both loops: the first
            ``accumulation_steps - 1`` under ``model.no_sync()`` or ``model.set_requires_gradient_sync(False)``,
            the last one reducing (and, in backward, stepping).
        autocast_dtype: run the forward and the loss under ``torch.autocast`` with this dtype (mixed precision:
            the parameters, gradients and state keep theirs).
        world_size, parallel: the layout, planned for one representative rank, each rank on its own
            ``batch_fn()`` micro-batch: ``"none"`` (one process, ``world_size=1``), ``"ddp"``
            (``DistributedDataParallel`` over ``world_size`` ranks; the engine steps DDP's buckets, so
            ``bucket_cap_mb`` does not apply), ``"fsdp2"`` (``fully_shard`` over ``world_size`` ranks), ``"tp"``
            (tensor parallel over ``world_size`` ranks: ``parallelize``), ``"fsdp2+tp"`` (a ``("dp", "tp")`` mesh
            of ``(world_size / tp_size, tp_size)``: ``parallelize`` on "tp", then ``fully_shard`` on "dp"),
            ``"hsdp"`` (``fully_shard`` on a ``("replicate", "shard")`` mesh of ``(world_size / shard_size,
            shard_size)``); all but DDP on torch's fake process group and a mesh over it, which this call
            initializes and destroys. The TP ranks of a replica see the same micro-batch, as in a real job. Or
            ``"pp"`` (a pipeline of ``world_size`` stages, one per rank: every stage planned, see ``pp_stage_fn``).
        ddp_bucket_cap_mb, gradient_as_bucket_view: DDP's options (``None``: its default cap, 25 MiB, with a first
            bucket of 1 MiB).
        fsdp_units: FSDP2: ``fsdp_units(model)`` lists the modules ``fully_shard``-ed before the root (default: the
            entries of the ``nn.ModuleList`` holding the most parameters, a transformer's blocks); also for
            ``"fsdp2+tp"`` and ``"hsdp"``.
        n_microbatches, pp_schedule, pp_stage_fn: ``"pp"``: the schedule's micro-batches per step and its
            ``torch.distributed.pipelining`` name (``"1F1B"``, the trainer's default, or ``"GPipe"``; the others
            raise ``NotImplementedError``), and ``pp_stage_fn(model, stage_index, num_stages)``, a stage's module
            cut from the whole model (required). There ``batch_fn()`` makes one micro-batch ``(inputs, target)``
            and ``loss_fn(output, target)`` is the schedule's loss on the last stage.
        tp_size: ``"fsdp2+tp"``: the tensor-parallel ranks per replica (``"tp"``: ``None`` or ``world_size``).
        shard_size: ``"hsdp"``: the ranks each replica is sharded over.
        parallelize: ``"tp"``, ``"fsdp2+tp"``: ``parallelize(model, tp_mesh)``, called on the model built by
            ``model_fn`` (fake tensors) and the 1-D tensor-parallel ``DeviceMesh``; it applies the model's plan in
            place (``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ...;
            its return value, if a module, is used instead). Every trainable parameter must end a DTensor (the
            others replicated DTensors, as ``launch.tensor_parallel.tensor_parallel``, the trainer's GPT plan,
            makes them): plain ones next to DTensors are refused. ``loss_fn`` gets the model's output as it is (a
            DTensor, if the plan leaves one).
        backend: the process group's backend on the planned ranks, ``"gloo"`` or ``"nccl"`` (``None``: gloo on
            CPU, NCCL on CUDA). Under FSDP2, FSDP2 x TP and HSDP the plan adds gloo's buffers inside the all-gather
            (a flat output) and the reduce-scatter (a copy of the input) for each collective's duration, under
            ``communication``; none for NCCL, whose internal buffers are not torch's allocator's (not seen).
        **optimizer_kwargs: ``optimizer_class``'s options (``lr``, ...).

    Returns:
        A :class:`MemoryPlan`: each loop's peak, its split, the saving, bytes per parameter, both timelines. Under
        ``"pp"`` a ``PipelinePlan``: the stage with the highest peak, and ``stages``, every stage's plan.

    Raises:
        ValueError: an engine option is out of range (as ``InBackwardOptimizer`` raises it).
        NotImplementedError: a layout that is not planned, or an option the layout's optimizer refuses.

    Example:
        >>> import torch, dist_optim
        >>> p = dist_optim.plan(lambda: torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))),
        ...                     lambda: torch.randn(8, 512), lambda model, x: model(x).square().mean(),
        ...                     bucket_cap_mb=1, lr=1e-3)
        >>> [round(lp.breakdown["gradients"] / 2**20, 1) for lp in p.loops()]  # MiB at each loop's peak
        [4.0, 1.0]
        >>> p.saving_bytes > 2**20
        True
    """
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    engine = dict(bucket_cap_mb=bucket_cap_mb, per_parameter=per_parameter, accumulation_steps=accumulation_steps,
                  max_grad_norm=max_grad_norm, clip_mode=clip_mode, track_grad_norm=track_grad_norm)
    if parallel == "pp":
        from dist_optim._planner._pipeline import plan_pipeline

        check_backend(parallel, backend)
        p = plan_pipeline(model_fn, batch_fn, loss_fn, optimizer_class, world_size=world_size,
                          n_microbatches=n_microbatches, pp_schedule=pp_schedule, pp_stage_fn=pp_stage_fn,
                          engine=engine, autocast_dtype=autocast_dtype, optimizer_kwargs=optimizer_kwargs)
        for q in (p, *p.stages):
            q.options["backend"] = backend
        return p
    layout = Layout(parallel, world_size, ddp_bucket_cap_mb, gradient_as_bucket_view, fsdp_units, tp_size, shard_size,
                    parallelize, backend)
    layout.check(engine)
    plans = {}
    with layout.group() as mesh:
        for loop in LOOPS:
            plans[loop], n_params, device = _trace_loop(loop, model_fn, batch_fn, loss_fn, optimizer_class,
                                                        optimizer_kwargs, engine, autocast_dtype, layout, mesh)
    if parallel != "none" and backend is None:  # as the collectives chose it: by the tensors' device
        layout = dataclasses.replace(layout, backend="nccl" if device == "cuda" else "gloo")
    options = {**engine, **layout.recorded(),
               "autocast_dtype": None if autocast_dtype is None else str(autocast_dtype).split(".")[-1],
               "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
               "optimizer_kwargs": {k: v for k, v in optimizer_kwargs.items() if isinstance(v, (int, float, str))}}
    return MemoryPlan(plans["standard"], plans["in_backward"], n_params, options, NOT_SEEN + layout.not_seen())

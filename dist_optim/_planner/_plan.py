"""Will it fit? The memory of one training step, planned on fake tensors, for the standard loop and in backward.

:func:`plan` builds the model under ``FakeTensorMode`` (no real memory), runs a first step to create the optimizer
state, then traces the storages of a second, warm step: the peak, split into parameters, optimizer state, gradients,
activations and other, for ``loss.backward(); opt.step(); opt.zero_grad()`` and for ``InBackwardOptimizer``.
One process, or one representative rank of a DDP, FSDP2, TP, FSDP2 x TP or HSDP job (``world_size``, ``parallel``:
``_layouts``, ``_fsdp2``, ``_tp``), or every stage rank of a pipeline (``_pipeline``). The step traced and the
plan's types are ``_step``'s; ``python -m dist_optim.plan`` is ``_cli``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dist_optim._planner._fsdp2 import local
from dist_optim._planner._guard import FakeCopies, check_positions, named_operators
from dist_optim._planner._layouts import Layout, check_backend
from dist_optim._planner._lowbit import not_seen as lowbit_not_seen
from dist_optim._planner._lowbit import stand_in, steps_on_fake
from dist_optim._planner._memory_trace import MemoryTrace
from dist_optim._planner._pipeline import plan_pipeline
from dist_optim._planner._step import (
    LOOPS,
    NOT_SEEN,
    Job,
    LoopPlan,
    MemoryPlan,
    loop_plan,
)
from dist_optim._planner._workspaces import Workspaces
from dist_optim._torch_internals import (
    FakeTensorMode,
    fsdp_resized_tensors,
    tree_leaves,
)
from dist_optim.engine._options import InBackwardOptions, engine_keywords

__all__: list[str] = []

logger = logging.getLogger(__name__)

# the engine's options the planner models in both loops (the standard loop's counterpart of each); InBackwardOptions
# gives their defaults
PLANNED_OPTIONS = ("bucket_cap_mb", "per_parameter", "accumulation_steps", "max_grad_norm", "clip_mode",
                   "track_grad_norm", "random_draws")


# -- planning -------------------------------------------------------------------------------------------------------
def _trace_loop(loop: str, model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
                loss_fn: Callable[[nn.Module, Any], torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                optimizer_kwargs: dict[str, Any], engine_options: dict[str, Any],
                autocast_dtype: torch.dtype | None, layout: Layout, mesh: Any, workspaces: Workspaces,
                count: bool = False, first_step: bool = True) -> tuple[LoopPlan, int, str]:
    """One loop traced: its first step, then its warm step (planned, and with ``count`` its FLOPs and the bytes
    its collectives move)."""
    micro = engine_options.get("accumulation_steps", 1)
    built: list[nn.Module] = []  # the model, for naming the module of an operator that fails
    with FakeTensorMode(), layout.inside_fake_mode(), named_operators(built), warnings.catch_warnings():
        # the engine compares gradients' storage addresses, which fake tensors do not have (0, and a warning):
        # only FSDP2's shared reduce-scatter buffers depend on it
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # the plan's own figures say what a setting holding every gradient costs (the saving, the gradients)
        warnings.filterwarnings("ignore", message="InBackwardOptimizer holds every gradient")
        with FakeCopies():  # copy.deepcopy in the builder copies into this fake mode
            model = model_fn()
        built.append(model)
        trace: MemoryTrace | None = None  # the step's being traced, for seen(); none for an untraced first step

        def seen(p: torch.Tensor) -> None:
            if trace is None:
                return
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
        first = [batch_fn() for _ in range(micro)]
        check_positions(built[0], first)  # the model as built, before a wrapper hides its attributes
        # the first step creates the optimizer state: traced too (unless only a warm step is asked for), its peak
        # planned when it is the larger
        first_peak = 0
        if first_step:
            trace = MemoryTrace(layout.collective_buffers(), workspaces)
            with trace:
                if layout.resizes:
                    trace.follow(lambda: fsdp_resized_tensors(model))
                trace.seed([local(t) for t in job.resident()] + _tensors(first))
                job.step(first)
                trace.finish()
            first_peak = trace.peak
        else:
            job.step(first)
        del first
        batches = [batch_fn() for _ in range(micro)]
        extra: list[torch.Tensor] = []
        if hasattr(model, "bucket_buffers"):  # DDP rebuilds its buckets at the next forward: before the trace
            model.reducer.rebuild()
            extra = model.bucket_buffers()

        def phase(name: str) -> None:
            trace.phase = name
        job.phase = phase
        resident = [local(t) for t in job.resident()] + extra
        trace = MemoryTrace(layout.collective_buffers(), workspaces)
        trace.count_flops = count
        with trace:
            if layout.resizes:  # FSDP2's unsharded parameters, allocated and freed by resizing their storages
                trace.follow(lambda: fsdp_resized_tensors(model))
            trace.seed(resident + _tensors(batches))
            for t in extra:  # DDP's buckets hold gradients
                trace.block_of(t).is_grad = True
            start = trace.total
            trace.phase = "forward"
            job.step(batches)
            trace.finish()
        job.phase = lambda name: None
        device = next(model.parameters()).device.type
        plan = loop_plan(loop, trace, start, model, job)
        plan.first_step_peak_bytes = first_peak
        if count:
            plan.counts = {"flops": trace.flops, "collective_bytes": trace.collective_bytes}
        return plan, n_params, device


def _tensors(batches: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batches) if isinstance(t, torch.Tensor)]


def plan(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
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
    **kwargs: Any,
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
        **kwargs: the engine's options planned, as ``InBackwardOptimizer`` takes them, with its defaults
            (``bucket_cap_mb``, ``per_parameter``, ``accumulation_steps``, ``max_grad_norm``, ``clip_mode``,
            ``track_grad_norm``, and ``random_draws``, which changes the order of random draws, not memory; the
            others are refused), and ``optimizer_class``'s options (``lr``, ...). The
            standard loop clips as ``clip_mode`` says. Under ``"ddp"`` and ``"fsdp2"`` the micro-batches accumulate
            as those wrappers do, in both loops: the first ``accumulation_steps - 1`` under ``model.no_sync()`` or
            ``model.set_requires_gradient_sync(False)``, the last one reducing (and, in backward, stepping).

    Returns:
        A :class:`MemoryPlan`: each loop's peak, its split, the saving, bytes per parameter, both timelines. Under
        ``"pp"`` a ``PipelinePlan``: the stage with the highest peak, and ``stages``, every stage's plan.

    Raises:
        ValueError: an engine option is out of range (as ``InBackwardOptimizer`` raises it).
        NotImplementedError: a layout that is not planned, an engine option the planner does not model, or an
            option the layout's optimizer refuses.

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
    engine, optimizer_kwargs = _engine_options(kwargs)
    # a class whose step cannot run on fake tensors is traced as its state (_lowbit), said in not_seen
    traced = optimizer_class if steps_on_fake(optimizer_class) else stand_in(optimizer_class, optimizer_kwargs)
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    if parallel == "pp":
        check_backend(parallel, backend)
        p = plan_pipeline(model_fn, batch_fn, loss_fn, traced, world_size=world_size,
                          n_microbatches=n_microbatches, pp_schedule=pp_schedule, pp_stage_fn=pp_stage_fn,
                          engine=engine, autocast_dtype=autocast_dtype, optimizer_kwargs=optimizer_kwargs)
        for q in (p, *p.stages):
            q.options.update(backend=backend, optimizer_class=name)
            q.not_seen += _not_seen(optimizer_class, traced)
        return p
    layout = Layout(parallel, world_size, ddp_bucket_cap_mb, gradient_as_bucket_view, fsdp_units, tp_size, shard_size,
                    parallelize, backend)
    plans, n_params, device, workspaces = _trace(LOOPS, model_fn, batch_fn, loss_fn, traced, optimizer_kwargs, engine,
                                                 autocast_dtype, layout)
    if parallel != "none" and backend is None:  # as the collectives chose it: by the tensors' device
        layout = dataclasses.replace(layout, backend="nccl" if device == "cuda" else "gloo")
    options = {**engine, **layout.recorded(),
               "autocast_dtype": None if autocast_dtype is None else str(autocast_dtype).split(".")[-1],
               "optimizer_class": name,
               "optimizer_kwargs": {k: v for k, v in optimizer_kwargs.items() if isinstance(v, (int, float, str))}}
    return MemoryPlan(plans["standard"], plans["in_backward"], n_params, options,
                      NOT_SEEN + layout.not_seen() + _not_seen(optimizer_class, traced) + workspaces.said(),
                      workspaces.outside_bytes)


def _trace(loops: tuple[str, ...], model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
           loss_fn: Callable[[nn.Module, Any], torch.Tensor], traced: type[torch.optim.Optimizer],
           optimizer_kwargs: dict[str, Any], engine: dict[str, Any], autocast_dtype: torch.dtype | None,
           layout: Layout, count: bool = False, first_step: bool = True
           ) -> tuple[dict[str, LoopPlan], int, str, Workspaces]:
    layout.check(engine)
    plans = {}
    workspaces = Workspaces()  # calibrated once for both loops
    with layout.group() as mesh:
        for loop in loops:
            logger.info("tracing the %s loop on fake tensors, %s", loop.replace("_", " "), layout.describe())
            plans[loop], n_params, device = _trace_loop(loop, model_fn, batch_fn, loss_fn, traced, optimizer_kwargs,
                                                        engine, autocast_dtype, layout, mesh, workspaces, count,
                                                        first_step)
    return plans, n_params, device, workspaces


def trace_in_backward(model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
                      loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                      optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                      autocast_dtype: torch.dtype | None = None, world_size: int = 1, parallel: str = "none",
                      fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None, tp_size: int | None = None,
                      shard_size: int | None = None, parallelize: Callable[[nn.Module, Any], Any] | None = None,
                      backend: str | None = None, first_step: bool = True, **kwargs: Any) -> tuple[LoopPlan, int]:
    """The in-backward loop alone, as :func:`plan` traces it (not ``"pp"``), with the warm step's FLOPs and
    collective bytes (``LoopPlan.counts``): fit's one trace of a candidate (``first_step=False``: the first step
    run, not traced). Returns the plan and this rank's parameters."""
    engine, optimizer_kwargs = _engine_options(kwargs)
    traced = optimizer_class if steps_on_fake(optimizer_class) else stand_in(optimizer_class, optimizer_kwargs)
    layout = Layout(parallel, world_size, None, False, fsdp_units, tp_size, shard_size, parallelize, backend)
    plans, n_params, _, _ = _trace(("in_backward",), model_fn, batch_fn, loss_fn, traced, optimizer_kwargs, engine,
                                   autocast_dtype, layout, count=True, first_step=first_step)
    return plans["in_backward"], n_params


def _not_seen(optimizer_class: type, traced: type) -> tuple[str, ...]:
    return () if traced is optimizer_class else lowbit_not_seen(optimizer_class)


def _engine_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``plan``'s keyword arguments split into the engine's planned options (checked, with the engine's defaults:
    ``InBackwardOptions``) and the optimizer's."""
    keywords = engine_keywords()
    unmodelled = sorted(k for k in kwargs if k in keywords and k not in PLANNED_OPTIONS)
    if unmodelled:
        raise NotImplementedError(f"plan() does not model the engine option(s) {', '.join(unmodelled)}; it plans "
                                  f"{', '.join(PLANNED_OPTIONS)} (leave the others out of the plan)")
    options = InBackwardOptions(**{k: v for k, v in kwargs.items() if k in PLANNED_OPTIONS})
    engine = {k: getattr(options, k) for k in PLANNED_OPTIONS}
    return engine, {k: v for k, v in kwargs.items() if k not in keywords}

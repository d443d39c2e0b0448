"""Pipeline stages for the memory planner: each stage rank of a ``torch.distributed.pipelining`` job (one stage per
rank, ``parallel="pp"``), its schedule run on fake tensors over torch's fake process group.

Every stage is planned on its own fake rank: torch's own ``PipelineStage`` and schedule (``Schedule1F1B``, the
trainer's default, or ``ScheduleGPipe``) run one warm ``schedule.step``, so the plan holds what they keep: the
activations of the micro-batches in flight (the schedule decides how many: 1F1B keeps ``num_stages - stage``,
GPipe all), the receive buffers of every micro-batch (activations from the stage before, gradients from the one
after, allocated at the first step and kept), the last stage's outputs of every micro-batch (the schedule keeps them
to merge, until the next step), the stage's gradients accumulated over the micro-batches. In backward is
``dist_optim.pipeline_optimizers``: each bucket stepped in the stage's last micro-batch backward.

The fake group's sends and receives complete at once and allocate nothing, and their Work holds no tensor: gloo
keeps a sent tensor alive while the schedule holds the send's Work, which the plan does not see (docs/planning.md
gives the size measured on 2 gloo ranks). :func:`planned_stage` makes a ``PipelineStage``
given every stage's input and output shapes (computed on fake tensors), so that it skips the warm-up exchange that
reads values from the other ranks; the warm step is the one the exchange would have set up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._planner._guard import FakeCopies, named_operators
from dist_optim._planner._memory_trace import MemoryTrace
from dist_optim._planner._step import (
    LOOPS,
    NOT_SEEN,
    Job,
    LoopPlan,
    MemoryPlan,
    MiB,
    in_backward_kernel,
    loop_plan,
)
from dist_optim._planner._workspaces import Workspaces
from dist_optim._torch_internals import (
    STAGE_WARMUP_RESULT,
    STAGE_WARMUP_VOTE,
    FakeTensorMode,
    clear_sharding_cache,
    fake_store,
    stage_kept_outputs,
    stage_recv_buffers,
    tree_leaves,
)
from dist_optim.pipeline import pipeline_optimizers

__all__: list[str] = []

logger = logging.getLogger(__name__)

PP_SCHEDULES = ("1F1B", "GPipe")  # the schedules planned (validated on 2 gloo ranks); torch's names
DEFAULT_SCHEDULE = "1F1B"  # launch.train's --pp-schedule default
DEFAULT_MICROBATCHES = 4  # launch.train's --microbatches default
NOT_SEEN_PP = ((
    "a sent tensor kept alive by the backend while the schedule holds the send's Work (gloo keeps it, the plan's "
    "fake group does not; NCCL not measured): on 2 gloo ranks one micro-batch's stage output or input gradient "
    "above the plan at most (0.2-0.6 % of the peak); gloo's sends and receives allocated no tensor besides "
    "(measured, benchmarks/bench_plan_pipeline.py)"),
)

StageFn = Callable[[nn.Module, int, int], nn.Module]  # (the whole model, stage index, number of stages) -> stage


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class ``name`` (torch's names, any case) if it is planned."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    planned = {s.lower(): s for s in PP_SCHEDULES}
    if name.lower() not in planned:
        try:
            get_schedule_class(name)
            why = ("not planned (its stages or split backwards are not validated against a measurement)")
        except ValueError:
            why = "not a torch.distributed.pipelining schedule"
        raise NotImplementedError(f"pp_schedule={name!r} is {why}; the planner plans {', '.join(PP_SCHEDULES)} "
                                  f"(default {DEFAULT_SCHEDULE}, the trainer's)")
    return get_schedule_class(planned[name.lower()])


# -- a stage on the fake group --------------------------------------------------------------------------------------
class _Static:
    """The warm-up vote's outcome as the schedule reads it (``.item()``): every stage's shapes are given (static)."""

    def item(self) -> int:
        return 1


@functools.cache
def planned_stage() -> type:
    """``PipelineStage`` given every shape (``input_args``, ``output_args``), without the warm-up exchange (the fake
    group's receives carry no values), telling ``phase`` where the schedule is: forward, backward. Made at first use:
    ``import dist_optim`` does not import ``torch.distributed.pipelining``."""
    from torch.distributed.pipelining import PipelineStage
    
    class PlannedStage(PipelineStage):
        phase: Callable[[str], None] = staticmethod(lambda name: None)  # type: ignore[assignment]

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            self.phase("forward")
            return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            self.phase("backward")
            return super().backward_one_chunk(*args, **kwargs)

    # the warm-up exchange: a vote sent through the stages and read back with .item(), which a fake tensor cannot
    # give; every shape is given, so the vote is "static" on every stage
    setattr(PlannedStage, STAGE_WARMUP_VOTE, lambda self, has_backward, received_acc=None: None)
    setattr(PlannedStage, STAGE_WARMUP_RESULT, lambda self, received_result=None: _Static())
    return PlannedStage


@contextlib.contextmanager
def fake_stage_group(world_size: int, rank: int) -> Iterator[None]:
    """Torch's fake process group of ``world_size`` ranks, this process rank ``rank``; destroyed after."""
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        clear_sharding_cache()  # no fake mesh handed to a later job (_torch_internals)
        dist.destroy_process_group()


# -- the step, the same for planning and for measuring --------------------------------------------------------------
class PipelineJob(Job):
    """A stage, its schedule (``n_microbatches``, the schedule's ``loss_fn(output, target)`` on the last stage) and
    its optimizer in one loop: ``schedule.step()`` then ``opt.step(); opt.zero_grad()``, or
    ``pipeline_optimizers`` stepping in the last micro-batch backward. :func:`plan_pipeline` traces it on fake
    tensors and a validation runs it for real. ``step([(inputs, target)])`` runs one schedule step over the whole
    pipeline batch, as ``launch.pipeline.run_schedule`` does."""

    def __init__(self, stage: Any, schedule: type, n_microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 loop: str, optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                 engine_options: dict[str, Any]) -> None:
        self.stage = stage
        self.schedule = schedule(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
        super().__init__(stage.submod, loop, loss_fn, optimizer_class, optimizer_kwargs, engine_options)

    def _optimizer(self, optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                   engine_options: dict[str, Any]) -> torch.optim.Optimizer:
        if self.loop != "in_backward":
            return super()._optimizer(optimizer_class, optimizer_kwargs, engine_options)
        (opt,) = pipeline_optimizers(self.schedule, optimizer_class, **engine_options, **optimizer_kwargs)
        self.kernel = in_backward_kernel(opt)
        return opt

    def step(self, batches: Sequence[Any]) -> None:
        ((inputs, target),) = batches
        self.phase("forward")
        stage = self.stage
        losses: list[torch.Tensor] = []
        self.schedule.step(*((inputs,) if stage.is_first else ()),
                           **({"target": target, "losses": losses} if stage.is_last else {}))
        del losses
        self._standard_step()

    def resident(self) -> list[torch.Tensor]:
        """:meth:`Job.resident`, and what the stage keeps between steps: its receive buffers (and the gradients
        backward left on them) and the last stage's outputs of the step before."""
        acts, grads = stage_recv_buffers(self.stage)
        return super().resident() + acts + grads + stage_kept_outputs(self.stage)


# -- planning -------------------------------------------------------------------------------------------------------
def _stage_shapes(model: nn.Module, stage_fn: StageFn, num_stages: int, inputs: torch.Tensor
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every stage's (input, output) on one micro-batch (fake tensors; with autograd, whose ``requires_grad`` the
    stage's buffers take)."""
    shapes, x = [], inputs
    for k in range(num_stages):
        y = stage_fn(model, k, num_stages)(x)
        shapes.append((x.detach().requires_grad_(x.requires_grad), y.detach().requires_grad_(y.requires_grad)))
        x = y
    return shapes


def _trace_stage(loop: str, rank: int, num_stages: int, model_fn: Callable[[], nn.Module],
                 batch_fn: Callable[[], Any], loss_fn: Callable[[Any, Any], torch.Tensor], stage_fn: StageFn,
                 schedule: type, n_microbatches: int, optimizer_class: type[torch.optim.Optimizer],
                 optimizer_kwargs: dict[str, Any], engine: dict[str, Any]) -> tuple[LoopPlan, int, int]:
    """One loop's plan of stage ``rank``, its parameters and the bytes of its kept buffers (receive buffers)."""
    def pipeline_batch() -> tuple[Any, Any]:  # n micro-batches, one tensor each: the schedule splits them again
        micro = [batch_fn() for _ in range(n_microbatches)]
        return tuple(torch.cat([m[i] for m in micro]) for i in range(2))  # type: ignore[return-value]

    built: list[nn.Module] = []
    with fake_stage_group(num_stages, rank), FakeTensorMode(), named_operators(built), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCopies():
            model = model_fn()
        built.append(model)
        x0, _ = batch_fn()
        example_in, example_out = _stage_shapes(model, stage_fn, num_stages, x0)[rank]
        module = stage_fn(model, rank, num_stages)
        del model  # the other stages' parameters: a stage rank keeps its own
        trace = MemoryTrace(workspaces=Workspaces())  # CPU convolutions' own allocations, calibrated

        def seen(p: torch.Tensor) -> None:
            block = trace.block_of(p.grad)
            if block is not None:
                block.is_grad = True
        for p in module.parameters():  # before the optimizer's hooks, which free the gradient
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(seen)
        n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        device = next(module.parameters()).device
        stage = planned_stage()(module, rank, num_stages, device, input_args=example_in,
                                      output_args=example_out)
        del example_in, example_out
        job = PipelineJob(stage, schedule, n_microbatches, loss_fn, loop, optimizer_class, optimizer_kwargs, engine)
        job.step([pipeline_batch()])  # the first step creates the optimizer state and the stage's buffers
        batch = pipeline_batch()

        def phase(name: str) -> None:
            trace.phase = name
        job.phase = stage.phase = phase
        acts, grads = stage_recv_buffers(stage)
        with trace:
            trace.seed(job.resident() + [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)])
            kept = sum(trace.block_of(t).nbytes for t in acts + grads)
            for t in acts:  # a received activation is the stage's input, kept for its backward
                trace.block_of(t).phase = "forward"
            start = trace.total
            trace.phase = "forward"
            job.step([batch])
            trace.finish()
        return loop_plan(loop, trace, start, module, job), n_params, kept


@dataclass
class PipelinePlan(MemoryPlan):
    """The plan of every stage rank of a pipeline job; the fields of :class:`MemoryPlan` are those of the stage with
    the highest peak (``options["stage"]``), ``stages`` holds each stage's plan."""

    stages: list[MemoryPlan] = field(default_factory=list, repr=False)

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        out = super().to_dict(timeline=timeline)
        out["stages"] = [s.to_dict(timeline=timeline) for s in self.stages]
        return out

    def table(self) -> str:
        lines = [super().table(), "per stage (MiB)    standard  in backward  saving  kept receive buffers"]
        for k, s in enumerate(self.stages):
            lines.append(f"  stage {k}{'*' if k == self.options['stage'] else ' '}        "
                         f"{s.standard.peak_bytes / MiB:9.1f}  {s.in_backward.peak_bytes / MiB:11.1f}  "
                         f"{s.saving_bytes / MiB:6.1f}  {s.options['recv_buffer_bytes'] / MiB:8.1f}")
        lines.append("  * the stage above: the highest peak")
        return "\n".join(lines)


def check(world_size: int, engine: dict[str, Any], autocast_dtype: torch.dtype | None, n_microbatches: int,
          stage_fn: StageFn | None) -> None:
    """The refusals of ``plan(parallel="pp")``, before anything is built."""
    if stage_fn is None:
        raise ValueError("parallel='pp' needs pp_stage_fn(model, stage_index, num_stages) returning that stage's "
                         "module (e.g. launch.pipeline.gpt_stage for the trainer's GPT)")
    if world_size < 1 or n_microbatches < 1:
        raise ValueError(f"parallel='pp' plans world_size >= 1 stages (one per rank) and n_microbatches >= 1, got "
                         f"{world_size} and {n_microbatches}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("plan(parallel='pp') runs without a real process group; call it in a process that has "
                           "not initialized one")
    if engine.get("accumulation_steps", 1) != 1:
        raise ValueError(f"accumulation_steps={engine['accumulation_steps']} with parallel='pp': the schedule's "
                         "micro-batches are the accumulation; give n_microbatches")
    if autocast_dtype is not None:
        raise NotImplementedError("autocast_dtype with parallel='pp' is not planned (not validated against a "
                                  "measurement)")


def plan_pipeline(model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
                  loss_fn: Callable[[Any, Any], torch.Tensor], optimizer_class: type[torch.optim.Optimizer], *,
                  world_size: int, n_microbatches: int, pp_schedule: str, pp_stage_fn: StageFn | None,
                  engine: dict[str, Any], autocast_dtype: torch.dtype | None, optimizer_kwargs: dict[str, Any]
                  ) -> PipelinePlan:
    """``plan(parallel="pp")``: every stage of ``world_size`` (one per rank) planned on its own fake rank."""
    check(world_size, engine, autocast_dtype, n_microbatches, pp_stage_fn)
    assert pp_stage_fn is not None
    schedule = schedule_class(pp_schedule)
    engine = {k: v for k, v in engine.items() if k != "accumulation_steps"}  # pipeline_optimizers takes the count
    layout = (f"per stage rank, pp on {world_size} ranks ({schedule.__name__}, {n_microbatches} micro-batches)")
    stages = []
    for rank in range(world_size):
        loops = {}
        # in backward first: pipeline_optimizers refuses what it cannot step (clip modes needing every stage's
        # norm), with its reason, before a standard loop is traced for nothing
        for loop in reversed(LOOPS):
            logger.info("tracing the %s loop of stage %d of %d on fake tensors", loop.replace("_", " "), rank,
                        world_size)
            loops[loop], n_params, kept = _trace_stage(loop, rank, world_size, model_fn, batch_fn, loss_fn,
                                                       pp_stage_fn, schedule, n_microbatches, optimizer_class,
                                                       optimizer_kwargs, engine)
        options = {**engine, "parallel": "pp", "world_size": world_size, "layout": f"{layout}: stage {rank}",
                   "stage": rank, "n_microbatches": n_microbatches, "pp_schedule": schedule.__name__,
                   "recv_buffer_bytes": kept,
                   "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
                   "optimizer_kwargs": {k: v for k, v in optimizer_kwargs.items()
                                        if isinstance(v, (int, float, str))}}
        stages.append(MemoryPlan(loops["standard"], loops["in_backward"], n_params, options, NOT_SEEN + NOT_SEEN_PP))
    top = max(stages, key=lambda s: max(s.standard.peak_bytes, s.in_backward.peak_bytes))
    return PipelinePlan(top.standard, top.in_backward, top.n_params, dict(top.options), top.not_seen,
                        stages=stages)

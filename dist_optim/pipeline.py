"""In-backward optimizers for the stages of a ``torch.distributed.pipelining`` schedule.

A schedule runs one backward per micro-batch on each stage; a stage's gradients accumulate over them and can be
stepped only during its last one. :func:`pipeline_optimizers` builds one :class:`InBackwardOptimizer` per stage
of this rank, gated on the schedule's own micro-batch count and dividing the gradients by ``n`` as the schedule
would, and refuses the schedules and options whose step could not equal ``schedule.step(); opt.step()``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dist_optim._torch_internals import (
    PERFORM_REDUCE_GRAD,
    graph_task_id,
    is_schedule,
    n_microbatches,
    schedule_stages,
)
from dist_optim.engine._inputs import is_dtensor
from dist_optim.engine._link import engine_of
from dist_optim.engine._options import InBackwardOptions, engine_keywords
from dist_optim.engine._saving import speaking_as
from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["pipeline_optimizers"]

# What holds a plain stage's gradients, in the schedule's terms: its micro-batches, not an accumulation the user
# chose; one micro-batch per step would keep the saving but remove the overlap a pipeline is for
PIPELINE_TERMS = {
    "accumulation": (
        "the schedule's n_microbatches={n} (a plain stage's gradients accumulate in .grad over its {n} micro-batch "
        "backwards, in both loops, and it steps in the last)",
        "a fully_shard-ed stage (pipeline x FSDP2, single-stage schedules: the sharded gradients are freed as they "
        "step), or fewer micro-batches per schedule.step() (a larger pipeline bubble; 1 keeps the whole saving "
        "and leaves no overlap between stages)",
    ),
}

# Schedule actions that compute the weights' gradients with torch.autograd.grad, which never runs the
# post-accumulate-grad hooks the step fires on (zero-bubble schedules split each backward into I and W).
_SPLIT_BACKWARD = ("I", "W", "OVERLAP_F_B")


def pipeline_optimizers(
    schedule: Any, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> list[InBackwardOptimizer]:
    r"""One :class:`InBackwardOptimizer` per pipeline stage that ``schedule`` runs on this rank, each stepping its
    stage once per ``schedule.step()``, during that stage's last micro-batch backward.

    Each optimizer accumulates the first ``n - 1`` micro-batch backwards of its stage (``n``: the schedule's
    number of micro-batches, read from the schedule) and steps each bucket in the ``n``-th, freeing its gradients
    as it goes. With the schedule's ``scale_grads=True`` (its default) the schedule would divide the accumulated
    gradients by ``n`` after its last backward; they are stepped and gone by then, so the optimizer divides each
    bucket's gradients by ``n`` (``grad.div_(n)``, the schedule's own arithmetic) before stepping it instead. The
    result is ``schedule.step(...)`` followed by ``opt.step(); opt.zero_grad()`` with the same optimizer,
    bitwise for every ``n``. To scale the gradients yourself (``set_grad_multiplier``, e.g. by a token count),
    build the schedule with ``scale_grads=False``: with ``True``, a multiplier is refused.

    A stage ``fully_shard``-ed over its data-parallel ranks (pipeline x FSDP2, single-stage schedules) is
    different: the schedule turns FSDP2's gradient sync off in every micro-batch backward and reduce-scatters after
    the last one, outside any backward, from ``PipelineStage.perform_reduce_grad``, which runs the sharded
    parameters' hooks. The optimizer wraps that method of the stage object so that each bucket steps there, as
    its reduction lands, and the window ends before the schedule would divide the gradients. The unsharded
    gradients accumulated over the micro-batches are FSDP2's and alive until then in both loops: the saving is
    the sharded gradients, freed as they are stepped instead of kept until ``opt.step()``.

    Args:
        schedule: a ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or ``ScheduleLoopedBFS``
            built over this rank's ``PipelineStage``\ s.
        optimizer_class: as for :class:`InBackwardOptimizer`.
        **kwargs: the options of :class:`InBackwardOptimizer` and of ``optimizer_class``, given to every stage's
            optimizer; not ``accumulation_steps`` (the schedule's micro-batch count is used).

    Returns:
        The optimizers, in the order of the schedule's stages on this rank (one for a single-stage schedule).

    Raises:
        NotImplementedError: a zero-bubble schedule or a stage with a ``dw_builder`` (the weights' gradients are
            computed outside the hooks the step fires on); a DDP-wrapped stage (the schedule drives its reducer by
            hand); an FSDP2 stage in a schedule with several stages per rank, or DTensor parameters without
            ``fully_shard`` at the stage's root; ``clip_mode="exact"``, ``"two_pass"`` or ``"previous_norm"``
            with ``max_grad_norm`` (they need the norm of every stage).
        ValueError: ``accumulation_steps`` is given; ``schedule`` is not a pipelining schedule.

    Example:
        >>> opts = dist_optim.pipeline_optimizers(schedule, torch.optim.AdamW, lr=1e-3)  # doctest: +SKIP
        >>> for x, y in data:  # doctest: +SKIP
        ...     schedule.step(x) if is_first_stage else schedule.step(target=y)  # each stage steps inside
    """
    if "accumulation_steps" in kwargs:
        raise ValueError(
            f"accumulation_steps={kwargs['accumulation_steps']!r} was given to pipeline_optimizers: the schedule's "
            "micro-batch count sets it (one step per schedule.step()); leave it out"
        )
    _check_clipping(kwargs)
    stages = _stages_of(schedule)
    _check_full_backward(schedule, stages)
    n = int(n_microbatches(schedule))
    scale = bool(schedule.scale_grads)
    keywords = engine_keywords()
    given = {k: v for k, v in kwargs.items() if k in keywords}
    base = kwargs.get("options")
    engine_options = InBackwardOptions(**given) if base is None else dataclasses.replace(base, **given)
    rest = {k: v for k, v in kwargs.items() if k not in keywords and k != "options"}  # the optimizer's own
    for stage in stages:  # every stage first: a refused one must not leave the optimizers of those before attached
        _check_stage(schedule, stage, len(stages))
    optimizers: list[InBackwardOptimizer] = []
    try:
        for stage in stages:
            optimizers.append(_stage_optimizer(schedule, stage, n, scale, engine_options, optimizer_class, rest,
                                               kwargs.get("allow_local_steps", True)))
    except BaseException:
        for opt in optimizers:  # a stage whose optimizer raised (its class refused there): nothing stays attached
            opt.remove()
        raise
    return optimizers


def _stage_optimizer(schedule: Any, stage: Any, n: int, scale: bool, engine_options: InBackwardOptions,
                     optimizer_class: type[torch.optim.Optimizer], rest: dict[str, Any],
                     allow_local_steps: bool) -> InBackwardOptimizer:
    """The optimizer of one (checked) stage."""
    from torch.distributed.fsdp import (
        FSDPModule,  # a schedule exists only where torch.distributed does
    )

    module = stage.submod
    sharded = isinstance(module, FSDPModule)
    # the schedule's mean over its n micro-batches, taken as it takes it (grad.div_(n))
    options = dataclasses.replace(engine_options, grad_divisor=n if scale and n > 1 else None)
    if sharded:
        # The schedule turns FSDP2's gradient sync off in every micro-batch backward, so the sharded parameters'
        # hooks run once per schedule.step(), after the last backward, from perform_reduce_grad: each bucket
        # steps there, as its reduce-scatter lands, in a window that ends when the reduction does.
        opt = InBackwardOptimizer(module, optimizer_class, options=options, **rest)
        _reduce_in_window(stage, opt)
    else:
        # A plain stage's parameters live on its rank alone: stepping them on the local gradient is the
        # standard loop; its hooks run in every micro-batch backward, and the last one steps.
        options = dataclasses.replace(options, accumulation_steps=n, allow_local_steps=allow_local_steps)
        # the warning points at the user's pipeline_optimizers call, past this function and that one
        with speaking_as("a pipeline stage's InBackwardOptimizer", PIPELINE_TERMS, frames=2):
            opt = InBackwardOptimizer(module, optimizer_class, options=options, **rest)
    opt.register_step_pre_hook(_Guard(schedule, stage, n, scale, sharded))
    return opt


def _check_stage(schedule: Any, stage: Any, n_stages: int) -> None:
    """Refuse a stage whose optimizer could not step as ``schedule.step(); opt.step()`` would."""
    from torch.distributed.fsdp import FSDPModule

    module = stage.submod
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise NotImplementedError(
            f"stage {stage.stage_index} is wrapped in DistributedDataParallel, whose reducer the schedule "
            "drives by hand in the last micro-batch, around the communication hook this optimizer steps in; "
            "use plain stages, or a standard optimizer stepped after schedule.step()"
        )
    sharded = isinstance(module, FSDPModule)
    if not sharded and any(is_dtensor(p) for p in module.parameters()):
        raise NotImplementedError(
            f"stage {stage.stage_index} holds DTensor parameters but its module is not fully_shard-ed at its "
            "root (tensor parallel, or fully_shard on submodules only): the schedule reduces the gradients of "
            "an FSDP2 stage only through its root. fully_shard the stage module itself, or use plain stages"
        )
    if sharded and n_stages > 1:
        raise NotImplementedError(
            f"stage {stage.stage_index} is fully_shard-ed and {type(schedule).__name__} runs {n_stages} "
            "stages on this rank: pipeline x FSDP2 in backward is built and tested for single-stage schedules "
            "(ScheduleGPipe, Schedule1F1B), where the schedule reduces each stage through perform_reduce_grad; "
            "use one of them, or a standard optimizer stepped after schedule.step()"
        )
    if sharded and not hasattr(stage, PERFORM_REDUCE_GRAD):
        raise NotImplementedError(
            f"stage {stage.stage_index} is fully_shard-ed, and this torch ({torch.__version__}) reduces an "
            "FSDP2 stage's gradients inside its last micro-batch backward without the "
            "PipelineStage.perform_reduce_grad step that pipeline x FSDP2 in backward is built on (torch 2.10 "
            "and later have it); use plain stages, or a newer torch"
        )


class _ReduceWindow:
    """A stage object's ``perform_reduce_grad`` (the schedule's call after the stage's last backward) wrapped so
    that the hooks FSDP2 runs in it settle as one in-backward step of the stage's optimizer. The optimizer is held
    weakly, and a removed one (``opt.remove()``) or an evaluation (``schedule.eval()``, no backward) passes
    straight through to the schedule's own reduction; building the optimizers again points it at the new one."""

    def __init__(self, stage: Any, reduce: Callable[[int], None], opt: InBackwardOptimizer) -> None:
        self.stage, self.reduce = stage, reduce
        self.opt = weakref.ref(opt)

    def __call__(self, grad_scale_factor: int) -> None:
        opt = self.opt()
        engine = None if opt is None else engine_of(_first_param(opt))
        if engine is None or not engine.attached or not self.stage.has_backward:
            self.reduce(grad_scale_factor)
            return
        # The window must end (settling the buckets whose last gradient came, or that were being learned) before
        # the schedule's division of what is left: the stepped gradients were divided by the optimizer's divisor.
        with engine.outside_backward():
            self.reduce(1)
        if grad_scale_factor != 1:
            self.stage.scale_grads(grad_scale_factor)  # the gradients not stepped in the window, as the schedule would


def _first_param(opt: InBackwardOptimizer) -> torch.Tensor:
    return next(p for g in opt.param_groups for p in g["params"])


def _reduce_in_window(stage: Any, opt: InBackwardOptimizer) -> None:
    current = getattr(stage, PERFORM_REDUCE_GRAD)
    if isinstance(current, _ReduceWindow):
        current.opt = weakref.ref(opt)  # the last optimizer was removed: its parameters were free to take
    else:
        setattr(stage, PERFORM_REDUCE_GRAD, _ReduceWindow(stage, current, opt))


class _Guard:
    """Step pre hook: refuses a step whose schedule settings changed since the optimizer was built, or that runs
    while forwards of the stage still wait for their backward (so not in its last micro-batch backward: a
    ``schedule.step()`` that raised left backwards counted)."""

    def __init__(self, schedule: Any, stage: Any, n: int, scale: bool, sharded: bool) -> None:
        self.schedule, self.stage, self.n, self.scale, self.sharded = schedule, stage, n, scale, sharded

    def __call__(self, opt: InBackwardOptimizer, args: Any, kwargs: Any) -> None:
        if not self.sharded and graph_task_id() == -1:
            return  # opt.step() outside backward: a flush the user asked for (an FSDP2 stage steps out there)
        schedule = self.schedule
        if (n_microbatches(schedule), bool(schedule.scale_grads)) != (self.n, self.scale):
            raise RuntimeError(
                f"the schedule now has n_microbatches={n_microbatches(schedule)}, scale_grads={schedule.scale_grads}"
                f" but its optimizers were built for {self.n}, {self.scale}: build them again with "
                "pipeline_optimizers(schedule, ...)"
            )
        # With scale_grads the schedule's mean is ours to apply (the divisor); without it the multiplier is the user's.
        if self.scale and opt.grad_multiplier is not None:
            raise RuntimeError(
                f"grad_multiplier is {opt.grad_multiplier!r} but the schedule (scale_grads=True, {self.n} "
                "micro-batches) already scales the gradients, by dividing them by the micro-batch count. To scale "
                "them yourself (by a token count), build the schedule with scale_grads=False and "
                "pipeline_optimizers again, then set_grad_multiplier"
            )
        if self.stage.fwd_cache:
            raise RuntimeError(
                f"stage {self.stage.stage_index} would step while {len(self.stage.fwd_cache)} of its forwards wait "
                "for their backward, so not in its last micro-batch backward: a schedule.step() raised before its "
                "end and left backwards counted. Nothing was stepped in this backward; reload the last checkpoint"
            )


def _stages_of(schedule: Any) -> list[Any]:
    stages = schedule_stages(schedule)
    if not stages or not is_schedule(schedule) or not hasattr(schedule, "scale_grads"):
        raise ValueError(
            "schedule must be a torch.distributed.pipelining schedule (ScheduleGPipe, Schedule1F1B, "
            f"ScheduleInterleaved1F1B, ...) built over this rank's stages, got {type(schedule).__name__}"
        )
    return list(stages)


def _check_full_backward(schedule: Any, stages: list[Any]) -> None:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if isinstance(schedule, PipelineScheduleMulti) and not isinstance(getattr(schedule, "pipeline_order", None), dict):
        # the only place a multi-stage schedule's split-backward (zero-bubble) actions can be seen: without it the
        # refusal below would switch off in silence
        raise NotImplementedError(
            f"this torch ({torch.__version__}) keeps no pipeline_order dict on {type(schedule).__name__}, where "
            "dist_optim looks for the zero-bubble actions it must refuse; use a single-stage schedule (GPipe, 1F1B) "
            "or the torch version dist_optim was tested with"
        )
    order = getattr(schedule, "pipeline_order", None) or {}
    split = sorted({
        str(a.computation_type.value) for actions in order.values() for a in actions
        if a is not None and str(a.computation_type.value) in _SPLIT_BACKWARD
    })
    custom = [s.stage_index for s in stages if getattr(s, "dw_builder", None) is not None]
    if split or custom:
        what = (
            f"its order has {'/'.join(split)} actions (a zero-bubble schedule), which compute the weights' "
            "gradients with torch.autograd.grad and assign .grad by hand" if split else
            f"stages {custom} have a dw_builder, whose function computes the weights' gradients after the backward"
        )
        raise NotImplementedError(
            f"{type(schedule).__name__} is not supported: {what}, so the post-accumulate-grad hooks that step in "
            "backward never run and nothing would be stepped. Use ScheduleGPipe, Schedule1F1B or "
            "ScheduleInterleaved1F1B (full backwards), or a standard optimizer stepped after schedule.step()"
        )


def _check_clipping(kwargs: dict[str, Any]) -> None:
    mode = kwargs.get("clip_mode", "exact")
    if kwargs.get("max_grad_norm") is None or mode not in ("exact", "two_pass", "previous_norm"):
        return
    why = {
        "exact": "the last stage runs its last backward (where it steps) before the first stage's has started, so "
                 "the total norm is known on no stage when it steps, and waiting for it there would deadlock the "
                 "schedule",
        "two_pass": "the schedule runs the backwards, which opt.backward(loss) would have to run twice",
        "previous_norm": "each stage's optimizer measures the norm of its own stage only, so it would clip with a "
                         "stage's norm instead of the model's",
    }[mode]
    raise NotImplementedError(
        f"clip_mode={mode!r} with max_grad_norm under pipelining: the norm covers every stage, and {why}. Use "
        "clip_mode='per_parameter', or a standard optimizer with clipping after schedule.step()"
    )

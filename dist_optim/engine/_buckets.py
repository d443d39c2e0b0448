"""What the engine keeps per bucket and per backward, :class:`Run` (what one backward does with its gradients), and
what the engine asks of the optimizer it steps for (:class:`Owner`) and of a communication hook (:class:`Reductions`)."""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from dist_optim.engine._grad_policy import GradPolicy
from dist_optim.engine._stepper import InnerOptimizer

__all__: list[str] = []

OUTSIDE_BACKWARD = -1  # torch's graph task id outside any backward: a standard step(), a pipeline window
NO_TASK = -2  # the task of no backward at all: a hook that runs outside backward while it is current is refused


class Run(enum.Enum):
    """What one backward (or a step outside backward: a standard step, a pipeline window) does with the gradients
    its hooks see; decided as it begins."""

    NONE = enum.auto()  # no backward: before the first, and after a pipeline window ended; nothing is stepped
    ACCUMULATE = enum.auto()  # a micro-batch (no_step(), accumulation_steps): gradients stay in .grad, unstepped
    MEASURE = enum.auto()  # a two-pass step's first backward: each bucket measured for the global norm, then freed
    STEP = enum.auto()  # the backward of a training step: each bucket stepped as it completes, its gradients freed
    WINDOW = enum.auto()  # a STEP whose hooks run outside backward, in Engine.outside_backward() (a pipeline
    # schedule reducing FSDP2 gradients after its last micro-batch): begun and ended by that context
    STANDARD = enum.auto()  # step() outside backward: the gradients present stepped as one bucket, and kept

    @property
    def steps(self) -> bool:
        """Whether the gradients are taken from ``.grad`` at all (settled bucket by bucket)."""
        return self not in (Run.NONE, Run.ACCUMULATE)

    @property
    def frees_grads(self) -> bool:
        """Whether stepped gradients are set to ``None`` (all but a standard step, which keeps them)."""
        return self is not Run.STANDARD


class Bucket:
    """Tensors stepped together: learned from the first stepping backward, or a DDP bucket."""

    __slots__ = ("indices", "params", "size", "arrived", "inners", "nbytes_each", "nbytes", "cuda")

    def __init__(self, indices: list[int], params: list[torch.Tensor], inners: list[InnerOptimizer],
                 nbytes_each: list[int]) -> None:
        self.indices = indices
        self.params = params
        self.size = len(params)
        self.arrived = 0
        self.inners = inners  # one per optimizer class among the bucket's groups
        self.nbytes_each = nbytes_each  # per tensor: its (local) gradient's bytes
        self.nbytes = sum(nbytes_each)
        self.cuda = any(p.is_cuda for p in params)  # whether the CUDA stream rule applies when it frees gradients


class Backward:
    """The state of one backward; the next backward starts a new one."""

    __slots__ = ("task", "previous_task", "run", "takes_grads", "policy", "began", "held", "held_ok", "learning",
                 "learning_bytes", "ended", "cleared", "live_bytes", "peak_bytes", "tensors_stepped")

    def __init__(self, task: int, previous_task: int, run: Run, policy: GradPolicy | None) -> None:
        self.task = task  # the autograd graph task running it (OUTSIDE_BACKWARD: a standard step or a window)
        self.previous_task = previous_task  # the task of the backward before: seeing it again means a nested one
        self.run = run
        self.takes_grads = run.steps  # read by every gradient hook: a slot, not the enum's property
        self.policy = policy  # unscales, checks and clips the gradients of this step
        self.began = False  # whether the owner was told that the training step began (a first bucket stepped)
        self.held: list[tuple[Bucket, list[torch.Tensor]]] = []  # prepared buckets (and their tensors with a
        # gradient) waiting for the decision on the whole step
        self.held_ok = True  # whether every held bucket passed its checks
        self.learning: list[int] = []  # the parameters of the bucket being learned, in arrival order
        self.learning_bytes = 0  # their gradient bytes
        self.ended = run is Run.NONE  # whether its end ran; if not, the next backward recovers from it
        self.cleared = False  # whether opt.zero_grad() ran after it: nothing it left is in .grad any more
        self.live_bytes = 0  # gradient bytes arrived in it and not yet freed
        self.peak_bytes = 0  # the most ``live_bytes`` ever was
        self.tensors_stepped = 0


class Owner(Protocol):
    """What the engine needs from the optimizer it steps for."""

    def backward_begins(self) -> Run:
        """Called once at the start of every backward: ``Run.STEP``, ``Run.ACCUMULATE`` (into ``.grad``) or
        ``Run.MEASURE`` (the first backward of a two-pass step)."""

    def grad_policy(self) -> GradPolicy:
        """The policy that unscales, checks and clips the gradients of the step about to run."""

    def param_name(self, p: torch.Tensor) -> str:
        """``p``'s name, for errors."""

    def step_begins(self) -> None:
        """A training step is about to step its first bucket."""

    def bucket_stepped(self, params: list[torch.Tensor]) -> None:
        """``params`` (those of a bucket that had a gradient) were just stepped."""

    def step_ends(self, stepped: bool) -> None:
        """The backward that steps has settled every bucket; ``stepped``: whether any bucket was stepped."""


class Reductions(Protocol):
    """Buckets reduced by a communication hook, which settles them through :meth:`Engine.settle_reduced`."""

    def reset(self) -> None:
        """Forget the reductions of a backward that raised."""

    def finish(self) -> bool:
        """Settle every reduced bucket left; ``False``: call again from a callback queued now."""

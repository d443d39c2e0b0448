"""The in-backward engine: per-parameter hooks, buckets, and the one rule that settles a bucket.

Buckets are learned online, in the order gradients arrive: a parameter with no bucket yet joins the bucket being
learned, which is closed and settled when the next gradient would not fit in ``cap_bytes`` (or when it is full).
Closed buckets settle when their last gradient arrives; whatever is left when backward ends is settled by a
callback queued on the autograd engine. Hooks hold the engine weakly, so a dropped optimizer never keeps a model
alive through its parameters. The engine knows its owner only through :class:`Owner`.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from dist_optim._grad_policy import GradPolicy
from dist_optim._inputs import is_dtensor
from dist_optim._stepper import InnerOptimizer, Recipe, step_inner_optimizers

__all__: list[str] = []

_task_id: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Owner(Protocol):
    """What the engine needs from the optimizer it steps for."""

    def backward_steps(self) -> bool:
        """Called once at the start of every backward: does it step, or only accumulate into ``.grad``?"""

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


class _Bucket:
    __slots__ = ("indices", "params", "size", "arrived", "inners")

    def __init__(self, indices: list[int], params: list[torch.Tensor], inners: list[InnerOptimizer]) -> None:
        self.indices = indices
        self.params = params
        self.size = len(params)
        self.arrived = 0
        self.inners = inners  # one per optimizer class among the bucket's groups


class _Backward:
    """The state of one backward; the next backward starts a new one."""

    __slots__ = ("task", "previous_task", "steps", "policy", "frees_grads", "began", "held", "held_ok", "learning",
                 "learning_bytes", "ended")

    def __init__(self, task: int, previous_task: int, steps: bool, policy: GradPolicy | None,
                 frees_grads: bool = True) -> None:
        self.task = task  # the autograd graph task running it (-1: a standard step() outside backward)
        self.previous_task = previous_task  # the task of the backward before: seeing it again means a nested one
        self.steps = steps  # False: a micro-batch that only accumulates into .grad
        self.policy = policy  # unscales, checks and clips the gradients of this step
        self.frees_grads = frees_grads  # whether stepped gradients are set to None (not by a standard step())
        self.began = False  # whether the owner was told that the training step began
        self.held: list[tuple[_Bucket, list[torch.Tensor]]] = []  # prepared buckets (and their tensors with a
        # gradient) waiting for the decision on the whole step
        self.held_ok = True  # whether every held bucket passed its checks
        self.learning: list[int] = []  # the parameters of the bucket being learned, in arrival order
        self.learning_bytes = 0  # their gradient bytes
        self.ended = False  # whether its end-of-backward callback ran; if not, partial buckets are forgotten


class Engine:
    """Per-parameter hooks and buckets for one owner; ``comm_stepped``: ids of the parameters a communication
    hook (``reductions``) settles instead of their own hook."""

    def __init__(
        self,
        owner: Owner,
        recipe: Recipe,
        cap_bytes: int,
        per_parameter: bool,
        reductions: Reductions | None = None,
        comm_stepped: frozenset[int] = frozenset(),
    ) -> None:
        self.owner = owner
        self.recipe = recipe
        self.cap_bytes = cap_bytes
        self.per_parameter = per_parameter
        self.reductions = reductions
        self.comm_stepped = comm_stepped
        self.params: list[torch.Tensor] = []
        self.group_of: list[int] = []
        self.bucket_of: list[_Bucket | None] = []
        self.index_of: dict[int, int] = {}  # id(param) -> index
        self.sparse: set[int] = set()  # parameters whose gradients are sparse: for-loop steps, in groups of their own
        self.buckets: list[_Bucket] = []
        self.comm_buckets: dict[tuple[int, ...], _Bucket] = {}  # a DDP bucket's parameter ids -> its bucket
        self.handles: list[RemovableHandle] = []
        self.backward = _Backward(-1, -1, False, None)
        self.backward.ended = True

    # -- registration -------------------------------------------------------------------------------------------
    def add_params(self, group_index: int, params: list[torch.Tensor]) -> list[RemovableHandle | None]:
        """Hook ``params`` (but those in ``comm_stepped``); returns their hooks' handles (``None``: no hook)."""
        ref = weakref.ref(self)
        handles: list[RemovableHandle | None] = []
        for p in params:
            i = len(self.params)
            self.params.append(p)
            self.group_of.append(group_index)
            self.bucket_of.append(None)
            self.index_of[id(p)] = i
            handle = None if id(p) in self.comm_stepped else p.register_post_accumulate_grad_hook(_make_hook(ref, i))
            if handle is not None:
                self.handles.append(handle)
            handles.append(handle)
        return handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def rebuild(self) -> None:
        """Rebuild every bucket's inner optimizers after the owner's groups or state were replaced."""
        for b in (*self.buckets, *self.comm_buckets.values()):
            b.inners = self._inner_optimizers(b.indices)

    # -- the hot path: once per parameter per backward ----------------------------------------------------------
    def grad_ready(self, i: int) -> None:
        bw = self.backward
        tid = _task_id()
        if tid != bw.task:
            bw = self._begin(tid)
        if not bw.steps:
            return  # a micro-batch that accumulates: the gradient stays in .grad
        b = self.bucket_of[i]
        if b is None:
            self._learn(i, bw)
            return
        b.arrived += 1
        if b.arrived == b.size:
            self.settle(b, bw)

    def enter_backward(self) -> bool:
        """For a communication hook: begin this backward if it is new; whether it steps."""
        bw = self.backward
        tid = _task_id()
        if tid != bw.task:
            bw = self._begin(tid)
        return bw.steps

    def settle_reduced(self, params: list[torch.Tensor]) -> None:
        """Settle the bucket of a communication hook's reduced parameters (DDP rebuilds its buckets once, after
        iteration 0, so a bucket is found by its parameters)."""
        key = tuple(id(p) for p in params)
        b = self.comm_buckets.get(key)
        if b is None:
            indices = [self.index_of[k] for k in key]
            b = self.comm_buckets[key] = _Bucket(indices, list(params), self._inner_optimizers(indices))
        self.settle(b, self.backward)

    def _begin(self, tid: int) -> _Backward:
        last = self.backward
        if tid == last.previous_task or _started_inside_a_backward():
            _refuse_nested_backward()
        if not last.ended:
            for b in self.buckets:  # it raised before its end-of-backward callback: forget its partial buckets
                b.arrived = 0
        if self.reductions is not None:
            self.reductions.reset()
        steps = self.owner.backward_steps()
        policy = self.owner.grad_policy()
        self.backward = bw = _Backward(tid, last.task, steps, policy)
        if steps:
            policy.begin()
        _queue_callback(lambda: self._end_of_backward(tid))
        return bw

    def _learn(self, i: int, bw: _Backward) -> None:
        p = self.params[i]
        if p.grad is not None and p.grad.is_sparse:
            self.sparse.add(i)
        local = p.to_local() if is_dtensor(p) else p  # a shard holds only its part of the gradient
        nbytes = local.numel() * local.element_size()
        if bw.learning and bw.learning_bytes + nbytes > self.cap_bytes:
            self._close_learned(bw)  # never exceed the cap: a tensor that does not fit starts the next bucket
        bw.learning.append(i)
        bw.learning_bytes += nbytes
        if self.per_parameter or bw.learning_bytes >= self.cap_bytes:
            self._close_learned(bw)

    def _close_learned(self, bw: _Backward) -> None:
        indices, bw.learning, bw.learning_bytes = bw.learning, [], 0
        b = _Bucket(indices, [self.params[i] for i in indices], self._inner_optimizers(indices))
        for i in indices:
            self.bucket_of[i] = b
        self.buckets.append(b)
        self.settle(b, bw)

    # -- settling: the one rule for every bucket ----------------------------------------------------------------
    def settle(self, b: _Bucket, bw: _Backward) -> None:
        """All of ``b``'s gradients that will come in ``bw`` are here: step it, skip it, or hold it until the whole
        step is decided (:meth:`_settle_held`)."""
        b.arrived = 0
        policy = bw.policy
        if not policy.active:
            self._step(b, bw)
            return
        present = [p for p in b.params if p.grad is not None]
        if not present:
            return
        indices = [i for i, p in zip(b.indices, b.params) if p.grad is not None]
        ok = policy.prepare(indices, [p.grad for p in present], lambda k: self.owner.param_name(present[k]))
        if policy.hold:
            bw.held.append((b, present))
            bw.held_ok = bw.held_ok and ok
        else:
            self._step_or_skip(b, bw, present, ok)

    def _settle_held(self, bw: _Backward) -> None:
        if not bw.held:
            return
        held, bw.held = bw.held, []
        ok = bw.held_ok and bw.policy.finish_held([p.grad for _, present in held for p in present])
        for b, present in held:
            self._step_or_skip(b, bw, present, ok)

    def _step_or_skip(self, b: _Bucket, bw: _Backward, present: list[torch.Tensor], ok: bool) -> None:
        if ok:
            self._step(b, bw)
            return
        bw.policy.stats.params_skipped += len(present)
        for p in present:
            p.grad = None

    def _step(self, b: _Bucket, bw: _Backward) -> None:
        if not bw.began:
            bw.began = True
            self.owner.step_begins()
        t0 = time.perf_counter()
        stepped = [p for p in b.params if p.grad is not None]
        try:
            step_inner_optimizers(b.inners)
        finally:
            b.arrived = 0
        self.owner.bucket_stepped(stepped)
        if bw.frees_grads:
            for p in b.params:
                p.grad = None
        stats = bw.policy.stats
        stats.params_stepped += len(stepped)
        stats.step_time_s += time.perf_counter() - t0

    def _end_of_backward(self, tid: int) -> None:
        bw = self.backward
        if tid != bw.task:
            _refuse_nested_backward()
        if not bw.steps:
            bw.ended = True
            return
        if self.reductions is not None and not self.reductions.finish():
            _queue_callback(lambda: self._end_of_backward(tid))  # runs after DDP's finalize
            return
        if bw.learning:
            self._close_learned(bw)
        for b in self.buckets:
            if b.arrived:
                self.settle(b, bw)
        self._settle_held(bw)
        bw.ended = True
        self.owner.step_ends(bw.began)

    def step_standard(self, parts: list[tuple[int, list[torch.Tensor]]]) -> bool:
        """A standard ``step()`` outside backward on the gradients present, which are kept: the tensors of
        ``parts`` (group index, tensors: the owner's current groups) form one bucket, settled as a whole step.
        Returns whether it stepped; the caller ends the step (``policy.end``, post hooks)."""
        params = [p for _, ps in parts for p in ps]
        # gradients set by hand may be sparse although no backward has shown it: they take the for-loop
        split = [(gi, s, [p for p in ps if (p.grad is not None and p.grad.is_sparse) == s]) for gi, ps in parts
                 for s in (False, True)]
        b = _Bucket(list(range(len(params))), params, self.recipe.build([part for part in split if part[2]]))
        policy = self.owner.grad_policy()
        bw = _Backward(-1, -1, True, policy, frees_grads=False)
        policy.begin()
        self.settle(b, bw)
        self._settle_held(bw)
        return bw.began

    def _inner_optimizers(self, indices: list[int]) -> list[InnerOptimizer]:
        # One part per (facade group, sparse?), in the bucket's order.
        parts: dict[tuple[int, bool], list[torch.Tensor]] = {}
        for i in indices:
            parts.setdefault((self.group_of[i], i in self.sparse), []).append(self.params[i])
        return self.recipe.build([(gi, sparse, params) for (gi, sparse), params in parts.items()])


def _started_inside_a_backward() -> bool:
    """Whether the running backward was launched from an autograd Function's backward (a reentrant checkpoint):
    on this thread's stack, a backward entry point called (indirectly) by ``BackwardCFunction.apply``. Checked
    once per backward. A backward whose parameters all sit inside such segments would otherwise look like one
    training step per segment."""
    frame = sys._getframe(1)
    in_engine = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward" and code.co_filename.endswith(_GRAPH_PY):
            in_engine = True
        elif in_engine and code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
            return True
        frame = frame.f_back
    return False


_GRAPH_PY = os.path.join("autograd", "graph.py")
_FUNCTION_PY = os.path.join("autograd", "function.py")


def _refuse_nested_backward() -> None:
    raise RuntimeError(
        "a backward ran inside another backward (reentrant activation checkpointing, or autograd.backward "
        "called from a hook): parameters would be stepped on partial gradients. Use "
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
    )


def _make_hook(ref: weakref.ref[Engine], i: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        engine = ref()
        if engine is not None:
            engine.grad_ready(i)
        else:
            warnings.warn(
                "a parameter's InBackwardOptimizer was garbage-collected while its hooks were attached, so it is "
                "no longer stepped in backward and its gradient accumulates. Keep a reference to the optimizer "
                "for as long as you train, or call .remove() on it before dropping it",
                UserWarning,
                stacklevel=2,
            )

    return hook

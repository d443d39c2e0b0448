"""The in-backward engine: one post-accumulate-grad hook per parameter, buckets, end-of-backward flush.

Buckets are learned online, in the order gradients arrive: a parameter with no bucket yet joins the open bucket,
which is frozen and stepped when the next gradient would not fit in ``cap_bytes`` (or when it is full). Frozen buckets step when their last
gradient arrives; whatever is left when backward ends is stepped by a callback queued on the autograd engine.
Hooks hold the engine weakly, so a dropped optimizer never keeps a model alive through its parameters.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from dist_optim._inputs import is_dtensor
from dist_optim._owners import record_owner
from dist_optim._stepper import InnerOptimizer, Recipe, step_inner_optimizers

if TYPE_CHECKING:
    from dist_optim._grad_policy import GradPolicy
    from dist_optim.optimizer import InBackwardOptimizer

__all__: list[str] = []

_task_id: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class _Bucket:
    __slots__ = ("indices", "params", "size", "arrived", "inners")

    def __init__(self, indices: list[int], params: list[torch.Tensor]) -> None:
        self.indices = indices
        self.params = params
        self.size = len(params)
        self.arrived = 0
        self.inners: list[InnerOptimizer] = []  # one per optimizer class among the bucket's groups


class Engine:
    """Per-parameter hooks and buckets for one :class:`~dist_optim.InBackwardOptimizer`."""

    def __init__(
        self, owner: InBackwardOptimizer, recipe: Recipe, cap_bytes: int, per_parameter: bool, policy: GradPolicy
    ) -> None:
        self.owner = owner
        self.recipe = recipe
        self.policy = policy
        self.cap_bytes = cap_bytes
        self.per_parameter = per_parameter
        self.params: list[torch.Tensor] = []
        self.group_of: list[int] = []
        self.bucket_of: list[_Bucket | None] = []
        self.sparse: set[int] = set()  # parameters whose gradients are sparse: for-loop steps, in groups of their own
        self.buckets: list[_Bucket] = []
        self.handles: list[RemovableHandle] = []
        self.open: list[int] = []
        self.open_bytes = 0
        self.task = -1  # the autograd graph task of the current (or last) backward
        self.previous_task = -1
        self.stepping = False  # whether the current backward steps (False while accumulating micro-batches)
        self.pre_hooks_fired = False
        self.held: list[tuple[_Bucket, list[torch.Tensor]]] = []  # buckets waiting for a whole-step decision
        self.held_ok = True
        self.index_of: dict[int, int] = {}  # id(param) -> index
        self.hookless: set[int] = set()  # ids of parameters stepped by a communication hook, not their own hook
        self.comm_buckets: dict[tuple[int, ...], _Bucket] = {}  # a DDP bucket's parameter ids -> its bucket
        self.comm: Any = None  # the DDP communication hook, if any: finish() completes its pending buckets
        # plain tensors were accepted in a single process: every backward checks that no multi-rank group has
        # appeared since (a model wrapped in DDP afterwards would step on local gradients)
        self.recheck_world = False

    # -- registration -------------------------------------------------------------------------------------------
    def add_params(self, group_index: int, params: list[torch.Tensor]) -> None:
        ref = weakref.ref(self)
        for p in params:
            i = len(self.params)
            self.params.append(p)
            self.group_of.append(group_index)
            self.bucket_of.append(None)
            self.index_of[id(p)] = i
            handle = None if id(p) in self.hookless else p.register_post_accumulate_grad_hook(_make_hook(ref, i))
            if handle is not None:
                self.handles.append(handle)
            record_owner(p, self.owner, handle)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def rebind(self) -> None:
        """Rebuild every bucket's inner optimizers after the owner's groups or state were replaced."""
        for b in (*self.buckets, *self.comm_buckets.values()):
            self._build_steppers(b)

    # -- the hot path -------------------------------------------------------------------------------------------
    def grad_ready(self, i: int) -> None:
        tid = _task_id()
        if tid != self.task:
            self._begin(tid)
        if not self.stepping:
            return  # a micro-batch that accumulates: the gradient stays in .grad
        b = self.bucket_of[i]
        if b is None:
            self._learn(i)
            return
        b.arrived += 1
        if b.arrived == b.size:
            self.complete(b)

    def comm_bucket(self, params: list[torch.Tensor]) -> _Bucket:
        """The bucket of a communication hook's parameters (DDP rebuilds its buckets once, after iteration 0)."""
        key = tuple(id(p) for p in params)
        b = self.comm_buckets.get(key)
        if b is None:
            indices = [self.index_of[k] for k in key]
            b = self.comm_buckets[key] = _Bucket(indices, list(params))
            self._build_steppers(b)
        return b

    def begin_if_new(self) -> None:
        tid = _task_id()
        if tid != self.task:
            self._begin(tid)

    def _begin(self, tid: int) -> None:
        if tid == self.previous_task or _started_inside_a_backward():
            _refuse_nested_backward()
        if self.open or any(b.arrived for b in self.buckets):
            # The previous backward raised before its end-of-backward callback: forget its partial buckets.
            for b in self.buckets:
                b.arrived = 0
            self.open.clear()
            self.open_bytes = 0
        self.held.clear()
        if self.comm is not None:
            self.comm.reset()
        if self.recheck_world and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.owner._check_still_single_process()
        self.previous_task, self.task = self.task, tid
        self.stepping = self.owner._backward_steps()
        if self.stepping:
            self.policy.begin()
            self.pre_hooks_fired = False
            self.held_ok = True
        _queue_callback(lambda: self._end_of_backward(tid))

    def _learn(self, i: int) -> None:
        p = self.params[i]
        if p.grad is not None and p.grad.is_sparse:
            self.sparse.add(i)
        local = p.to_local() if is_dtensor(p) else p  # a shard holds only its part of the gradient
        nbytes = local.numel() * local.element_size()
        if self.open and self.open_bytes + nbytes > self.cap_bytes:
            self._close_open_bucket()  # never exceed the cap: a tensor that does not fit starts the next bucket
        self.open.append(i)
        self.open_bytes += nbytes
        if self.per_parameter or self.open_bytes >= self.cap_bytes:
            self._close_open_bucket()

    def _close_open_bucket(self) -> None:
        b = _Bucket(self.open, [self.params[i] for i in self.open])
        for i in self.open:
            self.bucket_of[i] = b
        b.arrived = b.size
        self.open = []
        self.open_bytes = 0
        self._build_steppers(b)
        self.buckets.append(b)
        self.complete(b)

    def complete(self, b: _Bucket) -> None:
        """All of ``b``'s gradients that will come this backward are here: step it, skip it, or hold it."""
        b.arrived = 0
        policy = self.policy
        if not policy.active:
            self.step_bucket(b)
            return
        present = [p for p in b.params if p.grad is not None]
        if not present:
            return
        indices = [i for i, p in zip(b.indices, b.params) if p.grad is not None]
        ok = policy.prepare(indices, [p.grad for p in present], lambda k: self.owner.param_name(present[k]))
        if policy.hold:
            self.held.append((b, present))
            self.held_ok = self.held_ok and ok
        elif ok:
            self.step_bucket(b)
        else:
            policy.stats.params_skipped += len(present)
            for p in present:
                p.grad = None

    def step_bucket(self, b: _Bucket) -> None:
        if not self.pre_hooks_fired:
            self.pre_hooks_fired = True
            self.owner._begin_training_step()
        t0 = time.perf_counter()
        stepped = [p for p in b.params if p.grad is not None]
        try:
            step_inner_optimizers(b.inners)
        finally:
            b.arrived = 0
        for hook in self.owner._bucket_step_hooks.values():
            hook(stepped)
        for p in b.params:
            p.grad = None
        stats = self.policy.stats
        stats.params_stepped += len(stepped)
        stats.step_time_s += time.perf_counter() - t0

    def _end_of_backward(self, tid: int) -> None:
        if tid != self.task:
            _refuse_nested_backward()
        if not self.stepping:
            return
        if self.comm is not None and not self.comm.finish():
            _queue_callback(lambda: self._end_of_backward(tid))  # runs after DDP's finalize
            return
        if self.open:
            self._close_open_bucket()
        for b in self.buckets:
            if b.arrived:
                self.complete(b)
        if self.held:
            held, self.held = self.held, []
            ok = self.held_ok and self.policy.finish_held([p.grad for _, present in held for p in present])
            for b, present in held:
                if ok:
                    self.step_bucket(b)
                else:
                    self.policy.stats.params_skipped += len(present)
                    for p in present:
                        p.grad = None
        self.policy.end(self.owner)
        if self.pre_hooks_fired:
            self.owner._end_training_step()

    # -- inner optimizers ---------------------------------------------------------------------------------------
    def _build_steppers(self, b: _Bucket) -> None:
        # One part per (facade group, sparse?), in the bucket's order.
        parts: dict[tuple[int, bool], list[torch.Tensor]] = {}
        for i in b.indices:
            parts.setdefault((self.group_of[i], i in self.sparse), []).append(self.params[i])
        b.inners = self.recipe.build([(gi, sparse, params) for (gi, sparse), params in parts.items()])


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

"""The in-backward engine: per-parameter hooks, buckets, and the one rule that settles a bucket.

Buckets are learned online, in the order gradients arrive: a parameter with no bucket yet joins the bucket being
learned, which is closed and settled when the next gradient would not fit in ``cap_bytes`` (or when it is full).
Closed buckets settle when their last gradient arrives; whatever is left when backward ends is settled by a
callback queued on the autograd engine. Each parameter holds its engine in its own ``__dict__``, where the garbage
collector sees it, so an optimizer lives as long as the parameters it steps; the hook takes the parameter and
closes over nothing, so no cycle runs through torch's C++ hook dicts and dropping model and optimizer frees both.
The engine knows its owner only through :class:`Owner`.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import OrderedDict
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
_NO_TASK = -2  # the task of no backward: _task_id() is -1 outside backward and >= 0 inside


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


class _Backward:
    """The state of one backward; the next backward starts a new one."""

    __slots__ = ("task", "previous_task", "steps", "measures", "policy", "frees_grads", "began", "held", "held_ok",
                 "learning", "learning_bytes", "ended", "live_bytes", "peak_bytes", "stepped")

    def __init__(self, task: int, previous_task: int, steps: bool, policy: GradPolicy | None,
                 frees_grads: bool = True, measures: bool = False) -> None:
        self.task = task  # the autograd graph task running it (-1: a standard step() outside backward)
        self.previous_task = previous_task  # the task of the backward before: seeing it again means a nested one
        self.steps = steps  # False: a micro-batch that only accumulates into .grad
        self.measures = measures  # the measuring pass of a two-pass step: gradients measured and freed, not stepped
        self.policy = policy  # unscales, checks and clips the gradients of this step
        self.frees_grads = frees_grads  # whether stepped gradients are set to None (not by a standard step())
        self.began = False  # whether the owner was told that the training step began
        self.held: list[tuple[_Bucket, list[torch.Tensor]]] = []  # prepared buckets (and their tensors with a
        # gradient) waiting for the decision on the whole step
        self.held_ok = True  # whether every held bucket passed its checks
        self.learning: list[int] = []  # the parameters of the bucket being learned, in arrival order
        self.learning_bytes = 0  # their gradient bytes
        self.ended = False  # whether its end-of-backward callback ran; if not, the next backward recovers
        self.live_bytes = 0  # gradient bytes arrived in it and not yet freed
        self.peak_bytes = 0  # the most ``live_bytes`` ever was
        self.stepped = 0  # tensors stepped in it


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
        self.hook_ids: list[int | None] = []  # per parameter: the id of our hook's handle (None: no hook)
        self.warned_later_hooks = False  # whether a hook registered after ours was named (once per engine)
        self.group_of: list[int] = []
        self.bucket_of: list[_Bucket | None] = []
        self.index_of: dict[int, int] = {}  # id(param) -> index
        self.sparse: set[int] = set()  # parameters whose gradients are sparse: for-loop steps, in groups of their own
        self.buckets: list[_Bucket] = []
        self.comm_buckets: dict[tuple[int, ...], _Bucket] = {}  # a DDP bucket's parameter ids -> its bucket
        self.comm_key_of: dict[int, tuple[int, ...]] = {}  # param index -> the key of its current DDP bucket
        self.nbytes: list[int] = []  # per parameter: its (local) gradient's bytes
        self.handles: list[RemovableHandle] = []
        self.backward = _Backward(_NO_TASK, _NO_TASK, False, None)
        self.backward.ended = True
        self.incomplete = False  # a bucket was stepped and the end of that backward has not completed
        self.arrival_checked = False  # whether the gradients' producers were looked at (once, in a stepping backward)
        self.at_once_bytes = 0  # gradient bytes that one autograd node hands over at once (whole-model compile)
        self.computed_with: dict[int, int] = {}  # param index -> a label of the autograd node that computes its
        # gradient together with its siblings' (from the first stepping backward's graph; empty if not found)
        self.measuring = False  # set by the owner around the measuring backward of a two-pass step

    # -- registration -------------------------------------------------------------------------------------------
    def add_params(self, group_index: int, params: list[torch.Tensor]) -> list[RemovableHandle | None]:
        """Link ``params`` to this engine and hook them (but those in ``comm_stepped``, which a communication hook
        settles); returns their hooks' handles (``None``: no hook)."""
        handles: list[RemovableHandle | None] = []
        for p in params:
            i = len(self.params)
            self.params.append(p)
            self.group_of.append(group_index)
            self.bucket_of.append(None)
            self.index_of[id(p)] = i
            local = p.to_local() if is_dtensor(p) else p  # a shard holds only its part of the gradient
            self.nbytes.append(local.numel() * local.element_size())
            p.__dict__[_LINK] = _Link(self, i)
            handle = None if id(p) in self.comm_stepped else p.register_post_accumulate_grad_hook(_grad_accumulated)
            self.hook_ids.append(None if handle is None else handle.id)
            if handle is not None:
                self.handles.append(handle)
            handles.append(handle)
        return handles

    def remove(self) -> None:
        """Detach: hooks removed, the parameters' links to this engine cleared."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p in self.params:
            link = p.__dict__.get(_LINK)
            if isinstance(link, _Link) and link.engine is self:
                del p.__dict__[_LINK]

    def rebuild(self) -> None:
        """Rebuild every bucket's inner optimizers after the owner's groups or state were replaced."""
        for b in (*self.buckets, *self.comm_buckets.values()):
            b.inners = self._inner_optimizers(b.indices)

    # -- the hot path: once per parameter per backward ----------------------------------------------------------
    def grad_ready(self, i: int) -> None:
        bw = self.backward
        tid = _task_id()
        if tid != bw.task:
            bw = self._begin(tid, i)
        if not bw.steps:
            return  # a micro-batch that accumulates: the gradient stays in .grad
        bw.live_bytes += self.nbytes[i]  # its peak is taken where gradients are freed
        b = self.bucket_of[i]
        if b is None:
            self._learn(i, bw)
            return
        b.arrived += 1
        if b.arrived == b.size:
            if not self.warned_later_hooks:
                self._check_later_hooks(i, bw)
            self.settle(b, bw, complete=True)

    def _check_later_hooks(self, i: int, bw: _Backward) -> None:
        """Parameter ``i``'s gradient completes a bucket inside its own hook: a post-accumulate-grad hook registered
        after ours runs once the bucket is stepped and its gradients freed, and finds ``.grad`` ``None``. Said once,
        naming the parameter, before that hook runs. (torch keeps a tensor's hooks in ``_post_accumulate_grad_hooks``
        in registration order; a torch without it is caught by the test of this warning.)"""
        if bw.policy is not None and bw.policy.hold:
            return  # held until backward ends (exact clipping): the later hook still sees the gradient
        hooks = getattr(self.params[i], "_post_accumulate_grad_hooks", None)
        mine = self.hook_ids[i]
        if not hooks or mine is None or next(reversed(hooks)) == mine:
            return
        self.warned_later_hooks = True
        warnings.warn(
            f"{self.owner.param_name(self.params[i])} has a post-accumulate-grad hook registered after the in-backward "
            "optimizer's: it runs after the bucket this tensor completes is stepped and its gradients are freed, so it "
            "sees the stepped tensor with .grad None. Use opt.register_bucket_step_hook(hook), called with every "
            "stepped tensor while its gradient is still set, or register the hook before building the optimizer (it "
            "then sees the gradient before the step)",
            UserWarning,
            stacklevel=3,
        )

    def enter_backward(self) -> bool:
        """For a communication hook: begin this backward if it is new; whether it steps."""
        bw = self.backward
        tid = _task_id()
        if tid != bw.task:
            bw = self._begin(tid, None)
        return bw.steps

    def settle_reduced(self, params: list[torch.Tensor]) -> None:
        """Settle the bucket of a communication hook's reduced parameters (DDP rebuilds its buckets once, after
        iteration 0, so a bucket is found by its parameters)."""
        key = tuple(id(p) for p in params)
        b = self.comm_buckets.get(key)
        if b is None:
            indices = [self.index_of[k] for k in key]
            for i in indices:  # buckets partition the parameters: one that overlaps the new one is DDP's old layout
                old = self.comm_key_of.get(i)
                if old is not None:
                    self.comm_buckets.pop(old, None)
                self.comm_key_of[i] = key
            b = self.comm_buckets[key] = _Bucket(indices, list(params), self._inner_optimizers(indices),
                                                 [self.nbytes[i] for i in indices])
        bw = self.backward
        bw.live_bytes += sum(self.nbytes[i] for i, p in zip(b.indices, b.params) if p.grad is not None)
        self.settle(b, bw)

    def outside_backward(self) -> _Window:
        """A context in which gradient hooks that run outside any backward settle as one backward that begins and
        ends with it: FSDP2 reduce-scatters by hand, after the last micro-batch backward, when a pipeline schedule
        drives it (``PipelineStage.perform_reduce_grad``), and runs the sharded parameters' hooks there."""
        return _Window(self)

    def _begin(self, tid: int, first: int | None, window: bool = False) -> _Backward:
        """A new backward, seen at the hook of parameter ``first`` (``None``: at a communication hook); ``window``:
        begun by :meth:`outside_backward`, which ends it."""
        last = self.backward
        if tid == -1 and not window:
            name = self.owner.param_name(self.params[first]) if first is not None else "a bucket"
            raise RuntimeError(
                f"the gradient hook of {name} ran outside any backward (something reduced or set gradients by hand "
                "and ran their hooks itself, as a pipeline schedule does for FSDP2 stages after its last backward), "
                "where the step has no end of backward to wait for, so it would not be stepped. For pipeline "
                "stages build the optimizers with dist_optim.pipeline_optimizers(schedule, ...); otherwise call "
                "opt.step() after setting the gradients"
            )
        if _compiled_autograd_on():
            self._refuse(tid, last, first, compiled_autograd_message())
        nested, roots = _backward_frames()
        if tid == last.previous_task or nested:
            _refuse_nested_backward()
        if not last.ended:
            self._recover(last, first)
        if self.reductions is not None:
            self.reductions.reset()
        measures = self.measuring
        steps = measures or self.owner.backward_steps()  # a measuring pass is counted by the stepping one
        policy = self.owner.grad_policy()
        if steps and not measures:
            if policy.two_pass and policy.phase == "":
                self._refuse(tid, last, first, _TWO_PASS_MESSAGE)
            _guard_graph(roots)
        self.backward = bw = _Backward(tid, last.task, steps, policy, measures=measures)
        if steps:
            policy.begin()
            if not self.arrival_checked and roots is not None:
                if self._check_arrival(roots):
                    # a reentrant checkpoint segment: refused before a bucket outside it (a head over the cap, or
                    # per_parameter) is stepped; its gradients are dropped by the next backward, as after any error
                    bw.learning = [first] if first is not None else []
                    _refuse_nested_backward()
                self.arrival_checked = True
        if not window:
            _queue_callback(lambda: self._end_of_backward(tid))
        return bw

    def _refuse(self, tid: int, last: _Backward, first: int | None, message: str) -> None:
        """Refuse the backward beginning at ``first``'s hook before anything steps; the gradients it leaves (``first``'s
        own is there already) are dropped by the next backward, as after any backward that raised."""
        self.backward = refused = _Backward(tid, last.task, True, None)
        refused.learning = [first] if first is not None else []
        raise RuntimeError(message)

    def _recover(self, last: _Backward, first: int | None) -> None:
        """The backward ``last`` never reached its end (it raised, was interrupted, or its callback was lost): its
        partial buckets are forgotten and, if it stepped, the gradients it left are dropped, so that this backward
        does not step on them. ``first``'s gradient already holds this backward's part too: dropped if it may
        hold a stale one."""
        mixed = last.steps and first is not None and (
            first in last.learning or any(first in b.indices for b, _ in last.held)
            or (self.bucket_of[first] is not None and _was_partial(self.bucket_of[first], last))
        )
        for b in self.buckets:
            b.arrived = 0
        if not last.steps:
            return  # a micro-batch that only accumulates: as in the standard loop, .grad keeps what it got
        dropped = 0
        for i, p in enumerate(self.params):
            if p.grad is not None and (i != first or mixed):
                p.grad = None
                dropped += 1
        if not (dropped or last.stepped):
            return
        stepped = (
            f"{last.stepped} tensors had already been stepped on its batch and the others not "
            "(opt.step_incomplete is True: the model holds a half-applied step; to recover exactly, reload the last "
            "checkpoint), and " if last.stepped else ""
        )
        first_note = (
            f" (including {self.owner.param_name(self.params[first])}, whose gradient from this backward had been "
            "added onto its stale one, so it is not stepped in this one)" if mixed else ""
        )
        warnings.warn(
            f"the previous backward did not finish (it raised or was interrupted before its end): {stepped}"
            f"{dropped} tensors' gradients left from it were dropped{first_note}, so that this backward does not "
            "step on them. See docs/limitations.md, 'A backward that raises'",
            RuntimeWarning,
            stacklevel=4,
        )

    def _check_arrival(self, roots: list[torch.Tensor]) -> bool:
        """Once: whether one autograd node hands over the gradients of every parameter (a model compiled whole,
        whose compiled backward returns them together): then they are all alive at once and buckets save nothing.
        Returns whether the graph holds a reentrant checkpoint segment (nothing else is looked at then)."""
        producers: dict[object, list[int]] = {}
        parents: dict[object, list[object]] = {}
        seen: set[int] = set()
        stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if getattr(node, "_forward_cls", None) is _REENTRANT_CHECKPOINT:
                return True
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    i = self.index_of.get(id(var))
                    if i is not None:
                        producers.setdefault(node, []).append(i)
                else:
                    parents.setdefault(nxt, []).append(node)
                    stack.append(nxt)
        self.computed_with = _computing_nodes(producers, parents)
        if len(producers) != 1:
            return False
        (indices,) = producers.values()
        total = sum(self.nbytes[i] for i in set(indices))
        if len(indices) < 2 or total <= self.cap_bytes:
            return False  # a single bucket: there was no saving to lose
        self.at_once_bytes = total
        warnings.warn(
            f"all {len(set(indices))} gradients ({total} bytes) arrive at once from one autograd node "
            f"({type(next(iter(producers))).__name__}), as with a model compiled whole (torch.compile(model)): they "
            "are all alive together, so stepping in backward saves no gradient memory. Compile per block instead "
            "(`for block in model.blocks: block.compile()`), which keeps the saving; opt.last_step.grad_bytes_peak "
            "reports the bytes held",
            UserWarning,
            stacklevel=4,
        )
        return False

    def _learn(self, i: int, bw: _Backward) -> None:
        p = self.params[i]
        if p.grad is not None and p.grad.is_sparse:
            self.sparse.add(i)
        nbytes = self.nbytes[i]
        if bw.learning and (bw.learning_bytes + nbytes > self.cap_bytes  # a tensor that does not fit starts the next
                            or _leaves_shared_buffer(self.params[bw.learning[-1]].grad, p.grad)):
            self._close_learned(bw, self._computed_with_last(bw.learning, i))
        bw.learning.append(i)
        bw.learning_bytes += nbytes
        if self.per_parameter or bw.learning_bytes >= self.cap_bytes:
            if not self.warned_later_hooks:
                self._check_later_hooks(i, bw)
            self._close_learned(bw)

    def _computed_with_last(self, learning: list[int], i: int) -> int:
        """How many of the last tensors learned were computed by the same autograd node as ``i``. Their gradients
        came into being together (a Linear's bias and weight, from one addmm backward), so a bucket that ended
        between them would be stepped while ``i``'s gradient is already alive, on top of it. They start the next
        bucket with ``i`` instead, even over the cap (they are alive together whatever the buckets), and each bucket
        then settles before the node that computes the next one's first gradient runs."""
        node = self.computed_with.get(i)
        k = 0
        while node is not None and k < len(learning) and self.computed_with.get(learning[-1 - k]) == node:
            k += 1
        return k

    def _close_learned(self, bw: _Backward, carry: int = 0) -> None:
        """Close the bucket being learned but for its last ``carry`` tensors, which start the next one (all of
        them: nothing closes)."""
        if carry >= len(bw.learning):
            return
        indices = bw.learning[:len(bw.learning) - carry]
        bw.learning = bw.learning[len(indices):]
        bw.learning_bytes = sum(self.nbytes[j] for j in bw.learning)
        b = _Bucket(indices, [self.params[i] for i in indices], self._inner_optimizers(indices),
                    [self.nbytes[i] for i in indices])
        for i in indices:
            self.bucket_of[i] = b
        self.buckets.append(b)
        self.settle(b, bw, complete=True)  # every gradient of a learned bucket arrived in this backward

    # -- settling: the one rule for every bucket ----------------------------------------------------------------
    def settle(self, b: _Bucket, bw: _Backward, complete: bool = False) -> None:
        """All of ``b``'s gradients that will come in ``bw`` are here: step it, skip it, or hold it until the whole
        step is decided (:meth:`_settle_held`). ``complete``: every tensor of ``b`` got its gradient in ``bw``
        (its hook ran), so none needs looking at."""
        b.arrived = 0
        policy = bw.policy
        if not policy.active:
            self._step(b, bw, complete)
            return
        present = [p for p in b.params if p.grad is not None]
        if not present:
            return
        indices = [i for i, p in zip(b.indices, b.params) if p.grad is not None]
        # a standard step() (outside backward) finds gradients a pipeline schedule has already divided by n: its
        # scale_grads ran on what was not stepped in backward, so the divisor is for stepping in backward only
        ok = policy.prepare(indices, [p.grad for p in present], lambda k: self.owner.param_name(present[k]),
                            divide=bw.frees_grads)
        if bw.measures:
            self._free(b, bw, len(present) == b.size)  # measured: the stepping pass computes it again
        elif policy.hold:
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
        self._free(b, bw, len(present) == b.size)

    def _step(self, b: _Bucket, bw: _Backward, complete: bool = False) -> None:
        if not bw.began:
            bw.began = True
            self.incomplete = True
            self.recipe.started.clear()  # group-level state: each group's first bucket of this step writes it
            self.owner.step_begins()
        t0 = time.perf_counter()
        stepped = list(b.params) if complete else [p for p in b.params if p.grad is not None]
        try:
            step_inner_optimizers(b.inners, self.recipe.started)
        finally:
            b.arrived = 0
        bw.stepped += len(stepped)
        self.owner.bucket_stepped(stepped)
        if bw.frees_grads:
            self._free(b, bw, len(stepped) == b.size)
        stats = bw.policy.stats
        stats.params_stepped += len(stepped)
        stats.step_time_s += time.perf_counter() - t0

    def _free(self, b: _Bucket, bw: _Backward, full: bool) -> None:
        """Drop the bucket's gradients (the step that read them was just queued on the current stream); ``full``:
        every tensor of the bucket has one."""
        bw.peak_bytes = max(bw.peak_bytes, bw.live_bytes)
        bw.live_bytes -= b.nbytes if full else sum(n for n, p in zip(b.nbytes_each, b.params) if p.grad is not None)
        # CUDA stream rule: a gradient may have been allocated on another stream than the one that ran the step
        # (FSDP2's reduce-scatter stream, DDP's bucket). Dropping it lets the caching allocator hand its block to
        # its allocation stream while the step's kernels may still read it, unless the block is recorded on the
        # stream that ran them. Which stream allocated it is not cheaply known; the default stream never differs
        # in the cases above, so record whenever the step ran elsewhere. On CPU there are no streams.
        if b.cuda and torch.cuda.current_stream() != torch.cuda.default_stream():
            stream = torch.cuda.current_stream()
            for p in b.params:
                if p.grad is not None:
                    (p.grad.to_local() if is_dtensor(p.grad) else p.grad).record_stream(stream)
        for p in b.params:
            p.grad = None

    def _end_of_backward(self, tid: int) -> None:
        bw = self.backward
        if tid != bw.task:
            _refuse_nested_backward()
        if tid == -1:
            bw.task = _NO_TASK  # a window ended: a hook outside backward after it is an error again
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
        self.incomplete = False
        if bw.measures:
            return  # the owner decides whether the stepping pass runs
        bw.policy.stats.grad_bytes_peak = max(bw.peak_bytes, bw.live_bytes, self.at_once_bytes)
        self.owner.step_ends(bw.began)

    def step_standard(self, parts: list[tuple[int, list[torch.Tensor]]]) -> bool:
        """A standard ``step()`` outside backward on the gradients present, which are kept: the tensors of
        ``parts`` (group index, tensors: the owner's current groups) form one bucket, settled as a whole step.
        Returns whether it stepped; the caller ends the step (``policy.end``, post hooks)."""
        params = [p for _, ps in parts for p in ps]
        # gradients set by hand may be sparse although no backward has shown it: they take the for-loop
        split = [(gi, s, [p for p in ps if (p.grad is not None and p.grad.is_sparse) == s]) for gi, ps in parts
                 for s in (False, True)]
        b = _Bucket(list(range(len(params))), params, self.recipe.build([part for part in split if part[2]]),
                    [0] * len(params))  # its gradients are kept: nothing is counted
        policy = self.owner.grad_policy()
        bw = _Backward(-1, -1, True, policy, frees_grads=False)
        policy.begin()
        self.settle(b, bw)
        self._settle_held(bw)
        self.incomplete = False
        return bw.began

    def _inner_optimizers(self, indices: list[int]) -> list[InnerOptimizer]:
        # One part per (facade group, sparse?), in the bucket's order.
        parts: dict[tuple[int, bool], list[torch.Tensor]] = {}
        for i in indices:
            parts.setdefault((self.group_of[i], i in self.sparse), []).append(self.params[i])
        return self.recipe.build([(gi, sparse, params) for (gi, sparse), params in parts.items()])


class _Window:
    """:meth:`Engine.outside_backward`: begins a backward on entry and ends it on a clean exit; after an error it
    is left unended, like a backward that raised, and the next backward recovers from it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        if _task_id() != -1:
            raise RuntimeError("Engine.outside_backward() entered inside a backward")
        self.engine._begin(-1, None, window=True)

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        engine = self.engine
        if kind is None:
            engine._end_of_backward(-1)
        else:
            engine.backward.task = _NO_TASK


def _computing_nodes(producers: dict[object, list[int]], parents: dict[object, list[object]]) -> dict[int, int]:
    """Param index -> a label of the node whose run computes its gradient: the node that feeds its AccumulateGrad or,
    above it, the first that is not a link of a chain (one parent, one child). ``F.linear`` reaches the weight
    through ``TBackward`` under the addmm's backward, which computes the weight's gradient along with the bias's."""
    labels: dict[int, int] = {}
    for node, indices in producers.items():
        top = node
        while len(parents.get(top, ())) == 1 and sum(n is not None for n, _ in top.next_functions) == 1:
            top = parents[top][0]
        for i in indices:
            labels.setdefault(i, id(top))  # ids of nodes all held here: distinct
    return labels


def _storage(grad: torch.Tensor | None) -> tuple[int, bool] | None:
    """The address of ``grad``'s (local) storage and whether that storage holds more than ``grad`` (a view of a
    shared buffer); ``None``: no dense gradient."""
    if grad is None or grad.is_sparse:
        return None
    local = grad.to_local() if is_dtensor(grad) else grad
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes() > local.numel() * local.element_size()


def _leaves_shared_buffer(last: torch.Tensor | None, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` lives in another storage than ``last``, a view of a shared buffer. FSDP2 hands each
    ``fully_shard`` unit's sharded gradients over as views of one reduce-scatter output, which stays alive while any
    of them does: a bucket that ran on into the next unit would hold the whole buffer of the one before (bytes the
    cap does not count) through the next reduce-scatter. Closed here, a bucket never spans two units, and from the
    second backward on each unit's last bucket steps at the unit's last gradient, inside its reduction."""
    a, b = _storage(last), _storage(grad)
    return a is not None and a[1] and b is not None and b[0] != a[0]


def _was_partial(b: _Bucket, last: _Backward) -> bool:
    return b.arrived > 0 or any(b is held for held, _ in last.held)


def _backward_frames() -> tuple[bool, list[torch.Tensor] | None]:
    """Read once per backward from this thread's stack: whether the running backward was launched from an autograd
    Function's backward (a reentrant checkpoint: a backward entry point called, indirectly, by
    ``BackwardCFunction.apply``), and the tensors it started from (``None`` if not found). A backward whose
    parameters all sit inside reentrant segments would otherwise look like one training step per segment."""
    frame = sys._getframe(1)
    roots = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward" and code.co_filename.endswith(_GRAPH_PY):
            if roots is None:
                outputs = frame.f_locals.get("t_outputs")
                roots = list(outputs) if isinstance(outputs, (list, tuple)) else []
        elif roots is not None and code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
            return True, roots
        frame = frame.f_back
    return False, roots


_STEPPED = "dist_optim.stepped"  # key in a graph root's node metadata: a backward through it stepped parameters

_TWO_PASS_MESSAGE = (
    "clip_mode='two_pass' steps through opt.backward(loss), which runs a measuring backward and then the stepping "
    "one; this backward was started otherwise (loss.backward()), and refused before anything was stepped. Call "
    "opt.backward(loss) in place of loss.backward(), or choose clip_mode='exact'"
)


def _guard_graph(roots: list[torch.Tensor] | None) -> None:
    """A backward that steps runs through the graph of ``roots``: a later backward over the same graph (kept with
    ``retain_graph=True``) is refused as it starts, by a pre-hook on the root's node, which lives and dies with the
    graph. Its saved tensors predate the step, which changed the parameters in place; torch would fail with a
    version error that does not say why, or step a second time on the same batch."""
    root = next((t.grad_fn for t in roots or () if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
    if root is None or root.metadata.get(_STEPPED):
        return
    root.metadata[_STEPPED] = True
    root.register_prehook(_refuse_stepped_graph)


def _refuse_stepped_graph(grad_outputs: object) -> None:
    raise RuntimeError(
        "backward() ran again over a graph kept with retain_graph=True, after a backward through it had already "
        "stepped the parameters in place (the optimizer steps inside backward): the graph's saved tensors predate "
        "that step, so nothing was stepped this time. Run a new forward for each backward that steps; to measure "
        "the global norm first and then clip and step, use clip_mode='two_pass' with opt.backward(loss)"
    )


def _compiled_autograd_on() -> bool:
    # Compiled autograd traces the hooks into a graph, where some never run and the end-of-backward callback is
    # lost: parameters would silently not be stepped. Checked once per backward.
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def compiled_autograd_message() -> str:
    return (
        "compiled autograd is on (torch._dynamo.config.compiled_autograd = True, or torch._dynamo."
        "compiled_autograd._enable): it traces the post-accumulate-grad hooks the in-backward step runs on, and "
        "some of them never run, so parameters would silently not be stepped. Turn compiled autograd off for this "
        "model (torch.compile without it still works: per block keeps the memory saving), or use a standard "
        "optimizer"
    )


# the autograd Function of torch.utils.checkpoint(..., use_reentrant=True), whose backward runs a backward inside
_REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
_GRAPH_PY = os.path.join("autograd", "graph.py")
_FUNCTION_PY = os.path.join("autograd", "function.py")


def _refuse_nested_backward() -> None:
    raise RuntimeError(
        "a backward ran inside another backward (reentrant activation checkpointing, or autograd.backward "
        "called from a hook): parameters would be stepped on partial gradients. Use "
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
    )


class _Link:
    """What a parameter holds in its ``__dict__``: its engine (kept alive by it) and its index there. A copy or a
    pickle of the parameter carries an empty ``OrderedDict`` instead (``torch.load(weights_only=True)`` accepts
    it): the copy is not stepped, as torch's hooks are not copied either."""

    __slots__ = ("engine", "index")

    def __init__(self, engine: Engine, index: int) -> None:
        self.engine = engine
        self.index = index

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return OrderedDict, ()

    def __deepcopy__(self, memo: dict[int, object]) -> OrderedDict:
        return OrderedDict()


_LINK = "_in_backward_engine"


def _grad_accumulated(param: torch.Tensor) -> None:
    # The one hook of every parameter: it reaches the engine through the parameter, so it holds nothing itself.
    link = param._in_backward_engine
    link.engine.grad_ready(link.index)

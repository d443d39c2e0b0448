"""The in-backward engine: per-parameter hooks, buckets, and the one rule that settles a bucket (:meth:`Engine.settle`).

Buckets are learned online in the first stepping backward (``dist_optim.engine._learning``). Closed buckets settle when
their last gradient arrives; whatever is left when backward ends is settled by a callback queued on the autograd
engine. Parameters reach their engine through ``dist_optim.engine._link``. The engine knows its owner (the training
step's edges, ``dist_optim._training_step``) only through :class:`Owner`.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils.hooks import RemovableHandle

from dist_optim._torch_internals import POST_ACCUMULATE_GRAD_HOOKS, compiled_autograd_on
from dist_optim._torch_internals import graph_task_id as _task_id
from dist_optim._torch_internals import queue_callback as _queue_callback
from dist_optim.engine._buckets import (
    NO_TASK,
    OUTSIDE_BACKWARD,
    Backward,
    Bucket,
    Owner,
    Reductions,
    Run,
)
from dist_optim.engine._guards import (
    STEPPED_GRAPH_MESSAGE,
    TWO_PASS_MESSAGE,
    backward_frames,
    compiled_autograd_message,
    guard_graph,
    reaches_stepped_graph,
    refuse_nested_backward,
)
from dist_optim.engine._inputs import is_dtensor
from dist_optim.engine._learning import Learner
from dist_optim.engine._link import LINK, Link, engine_of, grad_accumulated
from dist_optim.engine._recovery import recover
from dist_optim.engine._stepper import InnerOptimizer, Recipe, step_inner_optimizers

__all__: list[str] = []


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
        self.bucket_of: list[Bucket | None] = []
        self.index_of: dict[int, int] = {}  # id(param) -> index
        self.sparse: set[int] = set()  # parameters whose gradients are sparse: for-loop steps, in groups of their own
        self.buckets: list[Bucket] = []
        self.comm_buckets: dict[tuple[int, ...], Bucket] = {}  # a DDP bucket's parameter ids -> its bucket
        self.comm_key_of: dict[int, tuple[int, ...]] = {}  # param index -> the key of its current DDP bucket
        self.nbytes: list[int] = []  # per parameter: its (local) gradient's bytes
        self.handles: list[RemovableHandle] = []
        self.backward = Backward(NO_TASK, NO_TASK, Run.NONE, None)
        self.incomplete = False  # a bucket was stepped and the end of that backward has not completed
        self.kept_stepped_graph = False  # the last stepping backward kept its graph: the next one looks for it
        self.learner = Learner(self)

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
            p.__dict__[LINK] = Link(self, i)
            handle = None if id(p) in self.comm_stepped else p.register_post_accumulate_grad_hook(grad_accumulated)
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
            if engine_of(p) is self:
                del p.__dict__[LINK]

    def rebuild(self) -> None:
        """Rebuild every bucket's inner optimizers after the owner's groups or state were replaced."""
        for b in (*self.buckets, *self.comm_buckets.values()):
            b.inners = self._inner_optimizers(b.indices)

    def close_learned(self, indices: list[int], bw: Backward) -> None:
        """The learner closed a bucket of ``indices``, all of whose gradients arrived in ``bw``: settle it."""
        b = self.new_bucket(indices)
        for i in indices:
            self.bucket_of[i] = b
        self.buckets.append(b)
        self.settle(b, bw, complete=True)

    def new_bucket(self, indices: list[int]) -> Bucket:
        return Bucket(indices, [self.params[i] for i in indices], self._inner_optimizers(indices),
                      [self.nbytes[i] for i in indices])

    @property
    def attached(self) -> bool:
        """Whether hooks are registered (not after :meth:`remove`)."""
        return bool(self.handles)

    # -- the hot path: once per parameter per backward ----------------------------------------------------------
    def grad_ready(self, i: int) -> None:
        bw = self.backward
        tid = _task_id()
        if tid != bw.task:
            bw = self._begin(tid, i)
        if not bw.takes_grads:
            return  # a micro-batch that accumulates: the gradient stays in .grad
        bw.live_bytes += self.nbytes[i]  # its peak is taken where gradients are freed
        b = self.bucket_of[i]
        if b is None:
            self.learner.learn(i, bw)
            return
        b.arrived += 1
        if b.arrived == b.size:
            if not self.warned_later_hooks:
                self.check_later_hooks(i, bw)
            self.settle(b, bw, complete=True)

    def check_later_hooks(self, i: int, bw: Backward) -> None:
        """Parameter ``i``'s gradient completes a bucket inside its own hook: a post-accumulate-grad hook registered
        after ours runs once the bucket is stepped and its gradients freed, and finds ``.grad`` ``None``. Said once,
        naming the parameter, before that hook runs. (torch keeps a tensor's hooks in registration order, in the
        attribute ``POST_ACCUMULATE_GRAD_HOOKS`` names; a torch without it is caught by the test of this warning.)"""
        if self.warned_later_hooks or (bw.policy is not None and bw.policy.hold):
            return  # said once; or held until backward ends (exact clipping): the later hook still sees the gradient
        hooks = getattr(self.params[i], POST_ACCUMULATE_GRAD_HOOKS, None)
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
        return bw.run.steps

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
            b = self.comm_buckets[key] = self.new_bucket(indices)
        bw = self.backward
        bw.live_bytes += sum(self.nbytes[i] for i, p in zip(b.indices, b.params) if p.grad is not None)
        self.settle(b, bw)

    def outside_backward(self) -> _Window:
        """A context in which gradient hooks that run outside any backward settle as one backward that begins and
        ends with it: FSDP2 reduce-scatters by hand, after the last micro-batch backward, when a pipeline schedule
        drives it (``PipelineStage.perform_reduce_grad``), and runs the sharded parameters' hooks there."""
        return _Window(self)

    def _begin(self, tid: int, first: int | None, window: bool = False) -> Backward:
        """A new backward, seen at the hook of parameter ``first`` (``None``: at a communication hook); ``window``:
        begun by :meth:`outside_backward`, which ends it."""
        last = self.backward
        if tid == OUTSIDE_BACKWARD and not window:
            name = self.owner.param_name(self.params[first]) if first is not None else "a bucket"
            raise RuntimeError(
                f"the gradient hook of {name} ran outside any backward (something reduced or set gradients by hand "
                "and ran their hooks itself, as a pipeline schedule does for FSDP2 stages after its last backward), "
                "where the step has no end of backward to wait for, so it would not be stepped. For pipeline "
                "stages build the optimizers with dist_optim.pipeline_optimizers(schedule, ...); otherwise call "
                "opt.step() after setting the gradients"
            )
        nested, roots, retained = backward_frames()
        if tid == last.previous_task or nested:
            refuse_nested_backward()
        if not last.ended:
            recover(last, first, self.params, self.buckets, self.bucket_of, self.owner.param_name)
        if compiled_autograd_on():  # after _recover: what an unfinished backward left is dropped first
            self._refuse(tid, last, first, compiled_autograd_message())
        if self.reductions is not None:
            self.reductions.reset()
        run = self.owner.backward_begins()
        if window and run is Run.STEP:
            run = Run.WINDOW
        policy = self.owner.grad_policy()
        if run in (Run.STEP, Run.WINDOW):
            if policy.two_pass and policy.phase == "":
                self._refuse(tid, last, first, TWO_PASS_MESSAGE)
            if self.kept_stepped_graph and reaches_stepped_graph(roots):
                self._refuse(tid, last, first, STEPPED_GRAPH_MESSAGE)
            guard_graph(roots, retained)
            self.kept_stepped_graph = retained
        self.backward = bw = Backward(tid, last.task, run, policy)
        if run.steps:
            # gradients accumulated by the backwards before (accumulation) were all alive together at their end
            bw.peak_bytes = sum(n for n, p in zip(self.nbytes, self.params) if p.grad is not None)
            self.owner.gradients_held(bw.peak_bytes, sum(self.nbytes))
            try:
                policy.begin()
            except BaseException:  # refused (a GradScaler that never scaled), as by _refuse
                self._drop_gradient(first)
                raise
            if not self.learner.graph_read and roots is not None and self.learner.read_graph(roots):
                # a reentrant checkpoint segment: refused before a bucket outside it (a head over the cap, or
                # per_parameter) is stepped
                self._drop_gradient(first)
                refuse_nested_backward()
        if not window:
            _queue_callback(lambda: self._end_of_backward(tid))
        return bw

    def _refuse(self, tid: int, last: Backward, first: int | None, message: str) -> None:
        """Refuse the backward beginning at ``first``'s hook before anything steps."""
        self.backward = Backward(tid, last.task, Run.STEP, None)
        self._drop_gradient(first)
        raise RuntimeError(message)

    def _drop_gradient(self, first: int | None) -> None:
        """A backward refused at ``first``'s hook, its first: drop the gradient that hook got, this backward's alone
        (what an earlier unfinished backward left was dropped before), so that the next backward starts as if the
        refused one had not run. Were it kept, the next backward could not tell it from its own part and would
        drop both."""
        if first is not None:
            self.params[first].grad = None

    def gradients_cleared(self) -> None:
        """``opt.zero_grad()`` ran: whatever an unfinished backward left in ``.grad`` is gone, so the next backward
        keeps and steps all of its own gradients (it would otherwise drop its first tensor's, which it cannot tell
        from a stale one)."""
        self.backward.cleared = True

    # -- settling: the one rule for every bucket ----------------------------------------------------------------
    def settle(self, b: Bucket, bw: Backward, complete: bool = False) -> None:
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
        ok = policy.prepare(indices, present, lambda k: self.owner.param_name(present[k]),
                            divide=bw.run is not Run.STANDARD)
        if bw.run is Run.MEASURE:
            self._free(b, bw, len(present) == b.size)  # measured: the stepping pass computes it again
        elif policy.hold:
            bw.held.append((b, present))
            bw.held_ok = bw.held_ok and ok
        else:
            self._step_or_skip(b, bw, present, ok)

    def _settle_held(self, bw: Backward) -> None:
        if not bw.held:
            return
        held, bw.held = bw.held, []
        ok = bw.held_ok and bw.policy.finish_held([p for _, present in held for p in present])
        for b, present in held:
            self._step_or_skip(b, bw, present, ok)

    def _step_or_skip(self, b: Bucket, bw: Backward, present: list[torch.Tensor], ok: bool) -> None:
        if ok:
            self._step(b, bw)
            return
        bw.policy.stats.params_skipped += len(present)
        self._free(b, bw, len(present) == b.size)

    def _step(self, b: Bucket, bw: Backward, complete: bool = False) -> None:
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
        bw.tensors_stepped += len(stepped)
        self.owner.bucket_stepped(stepped)
        if bw.run.frees_grads:
            self._free(b, bw, len(stepped) == b.size)
        stats = bw.policy.stats
        stats.params_stepped += len(stepped)
        stats.step_time_s += time.perf_counter() - t0

    def _free(self, b: Bucket, bw: Backward, full: bool) -> None:
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
            refuse_nested_backward()
        if tid == OUTSIDE_BACKWARD:
            bw.task = NO_TASK  # a window ended: a hook outside backward after it is an error again
        if not bw.run.steps:
            bw.ended = True
            return
        if self.reductions is not None and not self.reductions.finish():
            _queue_callback(lambda: self._end_of_backward(tid))  # runs after DDP's finalize
            return
        if bw.learning:
            self.learner.close(bw)
        for b in self.buckets:
            if b.arrived:
                self.settle(b, bw)
        self._settle_held(bw)
        bw.ended = True
        self.incomplete = False
        if bw.run is Run.MEASURE:
            return  # the owner decides whether the stepping pass runs
        stats = bw.policy.stats
        stats.grad_bytes_peak = max(bw.peak_bytes, bw.live_bytes, self.learner.at_once_bytes)
        stats.grad_bytes_saved = max(0, sum(self.nbytes) - stats.grad_bytes_peak)
        self.owner.step_ends(bw.began)

    def step_standard(self, parts: list[tuple[int, list[torch.Tensor]]]) -> bool:
        """A standard ``step()`` outside backward on the gradients present, which are kept: the tensors of
        ``parts`` (group index, tensors: the owner's current groups) form one bucket, settled as a whole step.
        Returns whether it stepped; the caller ends the step (``policy.end``, post hooks)."""
        params = [p for _, ps in parts for p in ps]
        # gradients set by hand may be sparse although no backward has shown it: they take the for-loop
        split = [(gi, s, [p for p in ps if (p.grad is not None and p.grad.is_sparse) == s]) for gi, ps in parts
                 for s in (False, True)]
        b = Bucket(list(range(len(params))), params, self.recipe.build([part for part in split if part[2]]),
                    [0] * len(params))  # its gradients are kept: nothing is counted
        policy = self.owner.grad_policy()
        bw = Backward(OUTSIDE_BACKWARD, OUTSIDE_BACKWARD, Run.STANDARD, policy)
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
        if _task_id() != OUTSIDE_BACKWARD:
            raise RuntimeError("Engine.outside_backward() entered inside a backward")
        self.engine._begin(OUTSIDE_BACKWARD, None, window=True)

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        engine = self.engine
        if kind is None:
            engine._end_of_backward(OUTSIDE_BACKWARD)
        else:
            engine.backward.task = NO_TASK

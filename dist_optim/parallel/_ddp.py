"""The step under DDP: a communication hook reduces each bucket, then the engine steps it on the averaged gradient.

Per-parameter hooks would see the local gradient, before DDP's all-reduce: under DDP the engine's per-parameter
hooks are not registered and this hook drives the steps instead. Reductions are launched as DDP asks; a bucket is
stepped once its reduction is done, checked at each later hook call and waited for at the end of backward, always
on the autograd thread. DDP is told (``_set_optimizer_in_backward``) not to write the gradients back to ``.grad``.

With ``find_unused_parameters=True`` (or ``static_graph=True``) DDP reduces a zero for a parameter unused on this
rank; whether some other rank used it is known only after DDP's finalize. A bucket holding such a parameter waits
until then, and a parameter unused on every rank gets no gradient, so it is not stepped (as in the standard loop).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._torch_internals import (
    ddp_rebuilt_buckets,
    has_local_used_map,
    local_used_map,
    skip_grad_writeback,
)
from dist_optim.engine._engine import Engine

__all__: list[str] = []


def _mean_allreduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    # What DDP does without a hook (reducer.cpp, mark_variable_ready_dense): multiply by 1 / world (before the sum,
    # so low precision does not overflow), then sum. torch's allreduce_hook divides by the world instead, which
    # rounds otherwise when the world is no power of two (a third of the elements on 3 ranks): not the standard loop.
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def ddp_managed(ddp: nn.parallel.DistributedDataParallel) -> set[int]:
    """Ids of the parameters DDP reduces (those it does not ignore and that require grad)."""
    return set(reducer_indices(ddp))


def reducer_indices(ddp: nn.parallel.DistributedDataParallel) -> dict[int, int]:
    """id(param) -> the parameter's index in DDP's reducer, which indexes ``reducer._get_local_used_map()``: the
    order of ``DistributedDataParallel._build_params_for_reducer`` (modules, then their own parameters, first
    occurrence of a shared one)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    index: dict[int, int] = {}
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and id(p) not in index:
                index[id(p)] = len(index)
    return index


def check_ddp(ddp: nn.parallel.DistributedDataParallel | None, accumulation_steps: int,
              comm_hook: Callable[..., Any] | None) -> None:
    """The DDP model given as ``params`` (``None``: not a DDP model) checked with the options that concern it."""
    if ddp is None:
        if comm_hook is not None:
            raise ValueError("ddp_comm_hook is given but params is not a DistributedDataParallel model")
        return
    if accumulation_steps > 1:
        raise NotImplementedError(
            "accumulation_steps > 1 with DDP: DDP reduces in every backward. Accumulate with "
            "`with model.no_sync():` on the micro-batches that only accumulate, and accumulation_steps=1"
        )
    if (ddp.find_unused_parameters or ddp.static_graph) and not has_local_used_map(ddp.reducer):
        raise NotImplementedError(
            f"this torch ({torch.__version__}) has no DDP reducer._get_local_used_map, which tells which parameters "
            "were unused on every rank (find_unused_parameters=True, static_graph=True). Use a torch with it, or a "
            "standard optimizer"
        )


class _Reduction(NamedTuple):
    params: list[torch.Tensor]
    grads: list[torch.Tensor]  # views of DDP's bucket
    buffer: torch.Tensor
    fut: torch.futures.Future
    unused: list[bool] | None  # which parameters had no gradient on this rank, if any did


class DDPCommHook:
    """Registered on the DDP model with ``register_comm_hook`` by :meth:`attach`; an optional inner hook (e.g.
    torch's ``bf16_compress_hook``) does the reduction, then the engine settles the bucket. It is the engine's
    :class:`~dist_optim.engine._engine.Reductions`."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, inner: Callable | None, inner_state: Any) -> None:
        self.engine: Engine | None = None  # the engine it drives, from attach() on
        self.inner = inner if inner is not None else _mean_allreduce
        self.inner_state = inner_state if inner is not None else ddp.process_group
        self.ddp = weakref.ref(ddp)  # DDP holds this hook: a strong reference would be a cycle through C++
        self.index = reducer_indices(ddp)
        self.pending: list[_Reduction] = []
        self.deferred: list[_Reduction] = []  # reduced, waiting for DDP's finalize to say which params were used
        self.requeued = False

    def attach(self, engine: Engine) -> None:
        """Drive ``engine`` from DDP's buckets; once only, when the optimizer is complete (DDP keeps a
        communication hook for its lifetime)."""
        ddp = self.ddp()
        assert ddp is not None and self.engine is None
        self.engine = engine
        ddp.register_comm_hook(self, DDPCommHook.hook)
        skip_grad_writeback(ddp.reducer)  # otherwise DDP re-creates every .grad at the end of backward

    @staticmethod
    def hook(self, bucket):  # unannotated: DDP checks a hook's annotations against real classes, not strings
        if not self.engine.enter_backward():
            raise RuntimeError(
                "opt.no_step() and accumulation_steps do not apply under DDP, which reduces in every backward; "
                "accumulate with `with model.no_sync():` on the micro-batches that only accumulate"
            )
        # Captured before the inner hook: compression wrappers replace the bucket's buffer.
        params, grads, buffer = bucket.parameters(), bucket.gradients(), bucket.buffer()
        unused = None
        ddp = self.ddp()
        if ddp is not None and (ddp.find_unused_parameters or ddp.static_graph):
            # DDP reduced a zero for each of these; the standard loop leaves .grad None for those unused everywhere
            unused = [p.grad is None for p in params]
            if not any(unused):
                unused = None
        for p in params:
            # DDP has copied the gradient into its bucket (or .grad is a view of it): the step reads the bucket,
            # so a separate .grad (gradient_as_bucket_view=False) is freed now, not when the reduction is done.
            p.grad = None
        fut = self.inner(self.inner_state, bucket)
        self.pending.append(_Reduction(params, grads, buffer, fut, unused))
        self.step_ready(wait=False)
        return fut

    def step_ready(self, wait: bool) -> None:
        """Step the pending buckets, in order, whose reduction is done (all of them if ``wait``); defer those
        with a parameter unused on this rank."""
        while self.pending:
            r = self.pending[0]
            if not (wait or r.fut.done()):
                return
            # On CUDA, Future.wait() makes the current stream wait on the reduction, so the step queued below on
            # that stream reads the reduced bucket; the engine records the views on the current stream before
            # dropping them (its stream rule), as it does for every gradient it frees.
            result = r.fut.wait()
            if isinstance(result, list):
                result = result[0]
            if result is not r.buffer and result.data_ptr() != r.buffer.data_ptr():
                r.buffer.copy_(result)
            self.pending.pop(0)
            if r.unused is not None:
                self.deferred.append(r)
                continue
            for p, g in zip(r.params, r.grads):
                p.grad = g  # a view of DDP's bucket, which DDP keeps; stepping drops the reference
            self.engine.settle_reduced(r.params)

    def finish(self) -> bool:
        """Step every bucket left; False when some wait for DDP's finalize, which is queued after the calling
        end-of-backward callback: call again from a callback queued now, which runs after it."""
        self.step_ready(wait=True)
        if not self.deferred:
            return True
        if not self.requeued:
            self.requeued = True
            return False
        ddp = self.ddp()
        assert ddp is not None, "a DDP model whose hook ran was garbage-collected during its backward"
        used = local_used_map(ddp.reducer).tolist()  # summed over ranks by DDP's finalize
        assert len(used) == len(self.index), f"DDP reduces {len(used)} parameters, the hook knows {len(self.index)}"
        deferred, self.deferred, self.requeued = self.deferred, [], False
        for r in deferred:
            stepped = False
            for p, g, unused_here in zip(r.params, r.grads, r.unused):
                if not unused_here or used[self.index[id(p)]]:
                    p.grad = g
                    stepped = True
            if stepped:
                    self.engine.settle_reduced(r.params)
        return True

    def learns_buckets(self) -> bool:
        """Whether DDP will record, in this backward, the order gradients arrive in, to rebuild its buckets at the
        next forward (its first iteration; not with ``find_unused_parameters=True``). A second backward over the
        same forward would record every parameter twice, and rebuilding in between would reduce the second on
        another bucket layout, whose sums differ in the last bits on more than two ranks."""
        ddp = self.ddp()
        assert ddp is not None
        if ddp.static_graph:
            raise NotImplementedError(
                "clip_mode='two_pass' with DDP(static_graph=True): a static graph runs one backward per forward, "
                "and two_pass runs two. Use static_graph=False, or clip_mode='exact'"
            )
        return not ddp.find_unused_parameters and not ddp_rebuilt_buckets(ddp)

    def reduces(self) -> bool:
        """Whether DDP reduces the coming backward: its last forward ran outside ``no_sync()``."""
        ddp = self.ddp()
        assert ddp is not None
        return bool(getattr(ddp, "require_forward_param_sync", ddp.require_backward_grad_sync))

    def expect_backward(self, loss: torch.Tensor) -> None:
        """Arm DDP's reducer for one more backward over the forward whose backward it has reduced already (the
        stepping pass of ``clip_mode="two_pass"``), as DDP's forward arms it; otherwise that backward is not
        reduced at all."""
        ddp = self.ddp()
        assert ddp is not None
        ddp.reducer.prepare_for_backward([loss] if ddp.find_unused_parameters else [])

    def reset(self) -> None:
        """Forget the reductions of a backward that raised: they are not stepped by the next one."""
        self.pending.clear()
        self.deferred.clear()
        self.requeued = False


def reordering_refused(ddp: Any) -> str | None:
    """Why random draws reordered per bucket would differ across the ranks of ``ddp`` (a DDP model, or ``None``),
    else ``None``: DDP's communication hook steps its buckets in DDP's order on every rank, but a bucket with a
    parameter unused on one rank waits for DDP's finalize there only, and a parameter DDP ignores is stepped when
    its own gradient arrives, between buckets whose reductions may or may not be done by then."""
    if ddp is None:
        return None
    if ddp.find_unused_parameters or ddp.static_graph:
        return ("with DDP(find_unused_parameters=True) or static_graph=True, a bucket holding a parameter unused "
                "on one rank is stepped after the others on that rank only. Use DDP without them, or a standard "
                "training loop")
    managed = ddp_managed(ddp)
    ignored = [n for n, p in ddp.module.named_parameters() if p.requires_grad and id(p) not in managed]
    if ignored:
        return (f"{ignored[0]!r} and {len(ignored) - 1} more are parameters DDP ignores, stepped when their "
                "gradient arrives, between DDP's buckets at points that depend on when each reduction completes. "
                "Give those parameters to another optimizer, or use a standard training loop")
    return None

"""The step under DDP: a communication hook reduces each bucket, then the engine steps it on the averaged gradient.

Per-parameter hooks would see the local gradient, before DDP's all-reduce: under DDP the engine's per-parameter
hooks are not registered and this hook drives the steps instead. Reductions are launched as DDP asks; a bucket is
stepped once its reduction is done, checked at each later hook call and waited for at the end of backward, always
on the autograd thread. DDP is told (``_set_optimizer_in_backward``) not to write the gradients back to ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__: list[str] = []


def _mean_allreduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    # what DDP does without a hook: divide first (no overflow in low precision), then sum
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def ddp_managed(ddp: nn.parallel.DistributedDataParallel) -> set[int]:
    """Ids of the parameters DDP reduces (those it does not ignore and that require grad)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return {id(p) for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored}


def check_ddp(ddp: nn.parallel.DistributedDataParallel) -> None:
    if ddp.find_unused_parameters:
        raise NotImplementedError(
            "DDP with find_unused_parameters=True is not supported yet: which parameters were unused on every "
            "rank is known only after DDP's finalize. Build DDP with find_unused_parameters=False (the default), "
            "or use a standard optimizer"
        )


class DDPCommHook:
    """Registered on the DDP model with ``register_comm_hook``; an optional inner hook (e.g. torch's
    ``bf16_compress_hook``) does the reduction, then the bucket is stepped."""

    def __init__(self, engine: Any, ddp: nn.parallel.DistributedDataParallel, inner: Callable | None,
                 inner_state: Any) -> None:
        self.engine = engine
        self.inner = inner if inner is not None else _mean_allreduce
        self.inner_state = inner_state if inner is not None else ddp.process_group
        self.pending: list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.futures.Future]] = []
        ddp.register_comm_hook(self, DDPCommHook.hook)
        ddp.reducer._set_optimizer_in_backward()  # otherwise DDP re-creates every .grad at the end of backward

    @staticmethod
    def hook(self, bucket):  # unannotated: DDP checks a hook's annotations against real classes, not strings
        engine = self.engine
        engine.begin_if_new()
        if not engine.stepping:
            raise RuntimeError(
                "opt.no_step() and accumulation_steps do not apply under DDP, which reduces in every backward; "
                "accumulate with `with model.no_sync():` on the micro-batches that only accumulate"
            )
        # Captured before the inner hook: compression wrappers replace the bucket's buffer.
        params, grads, buffer = bucket.parameters(), bucket.gradients(), bucket.buffer()
        for p in params:
            # DDP has copied the gradient into its bucket (or .grad is a view of it): the step reads the bucket,
            # so a separate .grad (gradient_as_bucket_view=False) is freed now, not when the reduction is done.
            p.grad = None
        fut = self.inner(self.inner_state, bucket)
        self.pending.append((params, grads, buffer, fut))
        self.step_ready(wait=False)
        return fut

    def step_ready(self, wait: bool) -> None:
        """Step the pending buckets, in order, whose reduction is done (all of them if ``wait``)."""
        while self.pending:
            params, grads, buffer, fut = self.pending[0]
            if not (wait or fut.done()):
                return
            result = fut.wait()
            if isinstance(result, list):
                result = result[0]
            if result is not buffer and result.data_ptr() != buffer.data_ptr():
                buffer.copy_(result)
            self.pending.pop(0)
            for p, g in zip(params, grads):
                p.grad = g  # a view of DDP's bucket, which DDP keeps; stepping drops the reference
            self.engine.complete(self.engine.comm_bucket(params))

    def finish(self) -> None:
        self.step_ready(wait=True)

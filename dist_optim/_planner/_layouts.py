"""World sizes and layouts for the memory planner: one representative rank of a DDP job (here), of an FSDP2 job
(``_plan_fsdp2``: FSDP2's own code over torch's fake process group), or of a tensor-parallel, FSDP2 x TP or HSDP job
(``_plan_tp``: a fake device mesh), planned on fake tensors in this one process.

DDP: every rank holds the whole model, its optimizer state, its own micro-batch, and DDP's flat bucket buffers
(one gradient's worth, alive from construction on). :class:`PlannedDDP` stands in for
``DistributedDataParallel``: it allocates those buffers as DDP's reducer does (one bucket over everything in the
first iteration, then rebuilt in the order gradients arrived, ``bucket_cap_mb``, a first bucket of 1 MiB at the
default cap), copies each gradient into its bucket view as it is accumulated (``gradient_as_bucket_view=True``:
the view becomes ``.grad``), and hands each bucket, once complete, to the communication hook in DDP's order. It is
a ``DistributedDataParallel`` to ``InBackwardOptimizer``, which runs its own DDP path on it unchanged (its
communication hook, the bucket stepped once reduced); the reduction is one that completes at once (a sum of one
rank's gradient is that gradient; no value is read on fake tensors). What a real rank holds besides (gloo's or
NCCL's own buffers) is not seen: docs/planning.md gives its measured size on CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_optim._planner import _fsdp2, _tp
from dist_optim._torch_internals import (
    DDP_REBUILT_BUCKETS,
    SKIP_GRAD_WRITEBACK,
    ddp_bucket_assignment,
    ddp_first_bucket_bytes,
    ddp_rebuilt_buckets,
)

__all__: list[str] = []

PARALLEL = ("none", "ddp", "fsdp2", "tp", "fsdp2+tp", "hsdp", "pp")  # the layouts planned; others are refused
NOT_PLANNED: dict[str, str] = {}  # a layout named here is refused with its reason (none today)
_MESHED = ("tp", "fsdp2+tp", "hsdp")  # planned by _plan_tp, on a fake device mesh
_FSDP2 = ("fsdp2", "fsdp2+tp", "hsdp")  # the layouts running FSDP2's collectives
_DEFAULT_CAP_MB = 25.0  # DDP's bucket_cap_mb when none is given (its first bucket is 1 MiB then)


@dataclass(frozen=True)
class Layout:
    """How the planned rank's job is laid out: ``parallel`` over ``world_size`` ranks, and DDP's options."""

    parallel: str = "none"
    world_size: int = 1
    ddp_bucket_cap_mb: float | None = None  # DDP's bucket_cap_mb (None: its default, 25, with a 1 MiB first bucket)
    gradient_as_bucket_view: bool = False
    fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None  # FSDP2: the modules sharded before the root
    tp_size: int | None = None  # fsdp2+tp: the tensor-parallel ranks per replica (tp: world_size)
    shard_size: int | None = None  # hsdp: the ranks each replica is sharded over
    parallelize: Callable[[nn.Module, Any], Any] | None = None  # tp, fsdp2+tp: parallelize(model, tp_mesh)
    backend: str | None = None  # the ranks' backend, "gloo" or "nccl" (None: by device, gloo on CPU)

    @property
    def replaces_parameters(self) -> bool:
        """The wrapper puts new parameters (DTensors) in the model's place."""
        return self.parallel not in ("none", "ddp")

    @property
    def resizes(self) -> bool:
        """FSDP2 allocates and frees unsharded parameters by resizing storages."""
        return self.parallel in _FSDP2

    def collective_buffers(self) -> Callable[[Any, tuple[Any, ...]], int] | None:
        """What the backend allocates inside FSDP2's collectives (the trace's ``collective_buffers``); None where
        the layout runs none on a process group (one process; DDP's stand-in reduces at once, and gloo's all-reduce
        allocates nothing, measured)."""
        if self.parallel not in _FSDP2:
            return None
        return _fsdp2.collective_buffers(self.backend)

    def recorded(self) -> dict[str, Any]:
        """The options as JSON-ready values."""
        out = {"parallel": self.parallel, "world_size": self.world_size, "layout": self.describe(),
               "backend": self.backend}
        if self.parallel == "ddp":
            out.update(ddp_bucket_cap_mb=self.ddp_bucket_cap_mb, gradient_as_bucket_view=self.gradient_as_bucket_view)
        if self.parallel in _MESHED:
            shape, names = _tp.mesh_shape(self.parallel, self.world_size, self.tp_size, self.shard_size)
            out.update(mesh=dict(zip(names, shape)))
            if self.parallelize is not None:
                f = self.parallelize
                out.update(parallelize=f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}")
        return out

    def check(self, engine: dict[str, Any]) -> None:
        if self.parallel not in PARALLEL:
            why = NOT_PLANNED.get(self.parallel, "unknown")
            raise NotImplementedError(
                f"parallel={self.parallel!r} is not planned ({why}); the planner plans parallel in {PARALLEL} "
                "(one representative rank of a job on world_size ranks, each stage rank of a pipeline)")
        if self.world_size < 1 or (self.parallel == "none" and self.world_size != 1):
            raise ValueError(f"world_size={self.world_size} with parallel={self.parallel!r}: one process plans "
                             f"world_size=1; give parallel one of {PARALLEL[1:]} for more ranks")
        check_backend(self.parallel, self.backend)
        if self.parallel not in _MESHED and (self.tp_size, self.shard_size, self.parallelize) != (None, None, None):
            raise ValueError(f"tp_size, shard_size and parallelize apply to parallel in {_MESHED}, got parallel="
                             f"{self.parallel!r}")
        if self.parallel != "none" and dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"plan(parallel={self.parallel!r}) runs without a real process group; call it in a "
                               "process that has not initialized one")
        if self.parallel in _MESHED:
            _tp.check(self.parallel, self.world_size, self.tp_size, self.shard_size, self.parallelize, engine)

    @contextlib.contextmanager
    def group(self) -> Iterator[Any]:
        """FSDP2, TP, FSDP2 x TP, HSDP: torch's fake process group of ``world_size`` ranks and a mesh over it, for
        the planning's duration (``None`` for the other layouts)."""
        if self.parallel in _MESHED:
            with _tp.fake_mesh(*_tp.mesh_shape(self.parallel, self.world_size, self.tp_size, self.shard_size)) as mesh:
                yield mesh
            return
        if self.parallel != "fsdp2":
            yield None
            return
        with _fsdp2.fake_group(self.world_size) as mesh:
            yield mesh

    def wrap(self, model: nn.Module, mesh: Any) -> nn.Module:
        if self.parallel == "ddp":
            return PlannedDDP(model, self.world_size, self.ddp_bucket_cap_mb, self.gradient_as_bucket_view)
        if self.parallel == "fsdp2":
            return _fsdp2.shard(model, mesh, self.fsdp_units)
        if self.parallel in _MESHED:
            return _tp.wrap(model, mesh, self.parallel, self.parallelize, self.fsdp_units)
        return model

    def inside_fake_mode(self) -> contextlib.AbstractContextManager[Any]:
        """Entered above ``FakeTensorMode`` for the planning: a device mesh's real tensors run outside it."""
        if self.parallel in _MESHED:
            return _tp.RealMeshOps()
        return contextlib.nullcontext()

    def engine_options(self) -> dict[str, Any]:
        """InBackwardOptimizer's extra options for this layout."""
        return {"ddp_comm_hook": _reduced_at_once} if self.parallel == "ddp" else {}

    def not_seen(self) -> tuple[str, ...]:
        """What a rank of this layout holds that the plan cannot see, with its size where it was measured."""
        if self.parallel == "tp":
            return _tp.NOT_SEEN
        if self.parallel in _FSDP2:
            return _fsdp2.not_seen(self.backend)
        if self.parallel != "ddp":
            return ()
        return ("DDP's collectives: on 2 gloo ranks (CPU) they allocated no tensor on gloo's threads (measured, "
                "benchmarks/bench_plan_layouts.py); gloo's and NCCL's own internal buffers are not measured",)

    def describe(self) -> str:
        if self.parallel == "none":
            return "one process"
        out = f"per rank, {self.parallel} on {self.world_size} ranks"
        if self.parallel in ("fsdp2+tp", "hsdp"):
            shape, names = _tp.mesh_shape(self.parallel, self.world_size, self.tp_size, self.shard_size)
            out += f" ({' x '.join(f'{n} {k}' for n, k in zip(names, shape))})"
        return out


def check_backend(parallel: str, backend: str | None) -> None:
    """``backend`` is one the planner knows, given for a layout with ranks."""
    if backend is not None and backend not in _fsdp2.BACKENDS:
        raise ValueError(f"backend must be one of {_fsdp2.BACKENDS} or None (gloo on CPU, NCCL on CUDA), "
                         f"got {backend!r}")
    if backend is not None and parallel == "none":
        raise ValueError(f"backend={backend!r} applies to a job on ranks; give parallel one of {PARALLEL[1:]}, or "
                         "leave backend None for one process")


def _reduced_at_once(state: Any, bucket: Any) -> torch.futures.Future:
    """The planner's reduction: complete at once, in place (its values are not the point)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _Bucket:
    """What a communication hook is given (``dist.GradBucket``'s methods the engine uses)."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.Tensor], views: list[torch.Tensor],
                 last: bool) -> None:
        self._index, self._buffer, self._params, self._views, self._last = index, buffer, params, views, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def is_last(self) -> bool:
        return self._last


class _Reducer:
    """DDP's reducer, as far as memory goes: flat buckets, gradients copied in, buckets launched in order."""

    def __init__(self, ddp: PlannedDDP, params: list[torch.Tensor], cap: int, first_cap: int, view: bool) -> None:
        self.ddp, self.params, self.cap, self.first_cap, self.view = ddp, params, cap, first_cap, view
        self.order: list[int] = []  # the order gradients arrived in the first backward (DDP's rebuilt_params_)
        self.buffers: list[torch.Tensor] = []
        self.comm: tuple[Any, Any] | None = None
        # DDP's first iteration: one bucket over every parameter (per dtype), in reverse of definition order
        self._initialize(list(reversed(ddp_bucket_assignment(params, [sys.maxsize]))))

    def _initialize(self, buckets: list[list[int]]) -> None:
        self.buckets = buckets
        self.where: dict[int, tuple[int, torch.Tensor]] = {}
        self.buffers = []  # the old buffers go first (DDP clears its buckets before building the new ones)
        self.views: list[list[torch.Tensor]] = []
        for b, indices in enumerate(buckets):
            first = self.params[indices[0]]
            buffer = torch.empty(sum(self.params[i].numel() for i in indices), dtype=first.dtype, device=first.device)
            views, offset = [], 0
            for i in indices:
                p = self.params[i]
                v = buffer.narrow(0, offset, p.numel()).view(p.shape)
                offset += p.numel()
                views.append(v)
                self.where[i] = (b, v)
                if self.view and p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
            self.buffers.append(buffer)
            self.views.append(views)
        self.prepare_for_backward([])

    def rebuild(self) -> bool:
        """DDP's bucket rebuild at the second forward: the order gradients arrived in, ``[first cap, cap]``."""
        if ddp_rebuilt_buckets(self.ddp) or len(self.order) != len(self.params):
            return False
        tensors = [self.params[i] for i in self.order]
        self._initialize(ddp_bucket_assignment(tensors, [self.first_cap, self.cap], self.order))
        setattr(self.ddp, DDP_REBUILT_BUCKETS, True)
        return True

    # -- what DDP's Python side and the engine call ----------------------------------------------------------------
    def prepare_for_backward(self, outputs: Any) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.next_bucket = 0
        self.expect = True  # a backward that reduces: not under no_sync() (DDP's expect_autograd_hooks_)

    def ready(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s gradient was accumulated (DDP's autograd hook; under ``no_sync()`` it does nothing, and
        the gradient accumulates in ``.grad``)."""
        if not self.expect:
            return
        if not ddp_rebuilt_buckets(self.ddp) and i not in self.order:
            self.order.append(i)
        b, v = self.where[i]
        if p.grad is not None and p.grad.untyped_storage() is not v.untyped_storage():
            v.copy_(p.grad)
            if self.view:
                p.grad = v
        self.pending[b] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            k = self.next_bucket
            self.next_bucket += 1
            if self.comm is not None:
                state, hook = self.comm
                hook(state, _Bucket(k, self.buffers[k], [self.params[j] for j in self.buckets[k]], self.views[k],
                                    k == len(self.buckets) - 1))


# what the engine calls on DDP's reducer (skip_grad_writeback): DDP then leaves .grad alone at the end of backward,
# nothing of memory
setattr(_Reducer, SKIP_GRAD_WRITEBACK, lambda self: None)


class PlannedDDP(nn.parallel.DistributedDataParallel):
    """A stand-in for ``DistributedDataParallel(module)`` on one rank of ``world_size``, for the planner (see the
    module's docstring); DDP's constructor, which broadcasts and checks shapes across ranks, is not run."""

    def __init__(self, module: nn.Module, world_size: int, bucket_cap_mb: float | None,
                 gradient_as_bucket_view: bool) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.world_size = world_size
        self.find_unused_parameters = False
        self.static_graph = False
        self.process_group = None
        self.parameters_to_ignore: set[str] = set()
        self.require_forward_param_sync = self.require_backward_grad_sync = True
        setattr(self, DDP_REBUILT_BUCKETS, False)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
        cap = int((_DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
        first = ddp_first_bucket_bytes() if bucket_cap_mb is None else cap
        self.reducer = _Reducer(self, params, cap, first, gradient_as_bucket_view)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.reducer.ready(i, p))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        self.reducer.comm = (state, hook)

    def bucket_buffers(self) -> list[torch.Tensor]:
        """DDP's flat gradient buckets, alive for the model's lifetime."""
        return list(self.reducer.buffers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.reducer.rebuild()
            if self.require_backward_grad_sync:
                self.reducer.prepare_for_backward([])
            else:  # under no_sync(): the backward reduces nothing
                self.reducer.expect = False
        return self.module(*args, **kwargs)

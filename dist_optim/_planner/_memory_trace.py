"""A dispatch-level trace of the bytes that tensors' storages hold, for the memory planner (``dist_optim.plan``).

Every operator's outputs are seen as they are made (``TorchDispatchMode``) and every storage's end through a weak
reference, so the running sum is what the allocator would hold, on fake tensors as on real ones. Two things no
operator returns are added where the caller says: storages resized in place (FSDP2's unsharded parameters), whose
sizes are re-read at every operator (:meth:`MemoryTrace.follow`), and a backend's buffers for a collective's duration
(``collective_buffers``), and what a kernel allocates inside itself (``workspaces``: CPU convolutions, calibrated by
``_workspaces``). What else no operator returns is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from dist_optim._torch_internals import TorchDispatchMode, tree_iter
from dist_optim.engine._inputs import dtensor_class, is_dtensor

__all__: list[str] = []

_CUDA_BLOCK = 512  # bytes: the CUDA caching allocator rounds every request up to a multiple of this


class _Block:
    """One storage's bytes, when it was made (``phase``), whether it was ever a ``.grad``, and whether it is a
    backend's buffer for a collective (``is_comm``)."""

    __slots__ = ("nbytes", "phase", "is_grad", "is_comm", "is_workspace", "__weakref__")

    def __init__(self, nbytes: int, phase: str) -> None:
        self.nbytes = nbytes
        self.phase = phase
        self.is_grad = False
        self.is_comm = False
        self.is_workspace = False


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor) or t.is_sparse:
        return None
    if is_dtensor(t):  # a wrapper: the memory is its local tensor's (the wrapper's own storage holds nothing)
        t = t.to_local()
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a functional wrapper, a nested one)
        return None


_COLLECTIVES = ("c10d", "_c10d_functional")  # the operators' namespaces of torch.distributed's collectives


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_iter(tree) if isinstance(t, torch.Tensor))


def _rounded(nbytes: int) -> int:
    """A CUDA block's bytes: the caching allocator's smallest block and rounding (as torch's MemTracker)."""
    return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK


class MemoryTrace(TorchDispatchMode):
    """The live bytes of storages through a region: the running total, its peak, the blocks alive at the peak and
    a timeline of ``(event index, phase, bytes)`` points.

    Storages alive before the region (parameters, optimizer state) are given to :meth:`seed`; storages met for the
    first time inside it are counted from that moment to their end. ``phase`` (set by the caller) labels each new
    block with the part of the step that made it. ``collective_buffers(func, args)``, if given, is the bytes a
    backend allocates inside the collective operator ``func`` (0 for any other operator): counted for the
    operator's duration, as a block of its own.
    """

    def __init__(self, collective_buffers: Callable[[Any, tuple[Any, ...]], int] | None = None,
                 workspaces: Callable[[Any, tuple[Any, ...], dict[str, Any]], int] | None = None) -> None:
        super().__init__()
        self._collective_buffers = collective_buffers
        self._workspaces = workspaces
        self._followed: list[tuple[torch.UntypedStorage, _Block, bool]] = []  # resized in place (CUDA or not)
        self._source: Callable[[], Iterable[torch.Tensor]] | None = None  # where the followed tensors are listed
        self._blocks = WeakIdKeyDictionary()  # storage -> its _Block
        self._live: dict[int, _Block] = {}  # id(block) -> block, for the snapshot at the peak
        self.phase = "seed"  # the label new blocks get
        self.total = 0  # bytes alive now
        self.peak = 0  # the most bytes alive at once
        self.peak_phase = "seed"
        self.peak_blocks: list[tuple[_Block, int]] = []  # the blocks alive at the peak, with their bytes then
        self._peak_pending = False  # the peak rose and its blocks are not yet recorded
        self.timeline: list[tuple[int, str, int]] = [(0, "seed", 0)]
        self.events = 0
        self.finished = False
        self.collective_bytes = 0  # the larger of each collective's input and output, summed (fit's cost)
        self.count_flops = False  # fit's cost: the FLOPs of the operators traced, when asked
        self.flops = 0

    # -- counting ----------------------------------------------------------------------------------------------
    def seed(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages as alive from now on (once each)."""
        for t in tensors:
            self._see(t)
        self._settle_peak()
        self.timeline, self.events = [(0, self.phase, self.total)], 0

    def _see(self, t: Any) -> None:
        st = _storage(t)
        if st is None:
            return
        nbytes = _rounded(st.nbytes()) if t.device.type == "cuda" else st.nbytes()
        block = self._blocks.get(st)
        if block is not None:
            if block.nbytes != nbytes:  # resized in place (an out= operator, resize_)
                self._add(nbytes - block.nbytes)
                block.nbytes = nbytes
            return
        self._new_block(st, nbytes)

    def _new_block(self, st: torch.UntypedStorage, nbytes: int) -> None:
        block = _Block(nbytes, self.phase)
        self._blocks[st] = block
        self._live[id(block)] = block
        weakref.finalize(st, self._freed, id(block))
        if nbytes:
            self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        if nbytes < 0:
            self._settle_peak()
        self.total += nbytes
        self.events += 1
        self.timeline.append((self.events, self.phase, self.total))
        if self.total > self.peak:
            self.peak, self.peak_phase, self._peak_pending = self.total, self.phase, True

    def _freed(self, key: int) -> None:
        if self.finished:  # the region is over: what dies later (the model, when dropped) is not its memory
            return
        self._settle_peak()
        block = self._live.pop(key)
        if block.nbytes:
            self.total -= block.nbytes
            self.events += 1
            self.timeline.append((self.events, self.phase, self.total))

    def _settle_peak(self) -> None:
        # the blocks at the peak are copied once, when the total first falls from it (or at the end)
        if self._peak_pending:
            # the sizes then: a resize changes them. A snapshot first (copied in C, no Python code runs): a
            # collection during the loop may run a storage's finalizer, which removes its block from _live
            live = tuple(self._live.values())
            self.peak_blocks = [(b, b.nbytes) for b in live]
            self._peak_pending = False

    def follow(self, source: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Re-read the storage sizes of the tensors ``source()`` lists at every operator from now on: storages
        resized in place, which no operator reports (FSDP2 allocates and frees its unsharded parameters so, between
        operators). Counted at their size now. ``source`` is asked again before every collective: FSDP2 makes
        those storages at a unit's first all-gather, in the first step."""
        self._source = source
        self._refresh()

    def _refresh(self) -> None:
        followed = {id(block) for _, block, _ in self._followed}
        for t in self._source():
            st = _storage(t)
            if st is not None:
                self._see(t)
                if id(self._blocks[st]) not in followed:
                    self._followed.append((st, self._blocks[st], t.device.type == "cuda"))

    def _reread(self) -> None:
        for st, block, cuda in self._followed:
            nbytes = _rounded(st.nbytes()) if cuda else st.nbytes()
            if nbytes != block.nbytes:  # (a free settles the peak first, with the block at its old size)
                if not block.nbytes:  # allocated anew: made in this phase
                    block.phase = self.phase
                self._add(nbytes - block.nbytes)
                block.nbytes = nbytes

    def block_of(self, t: torch.Tensor) -> _Block | None:
        st = _storage(t)
        return None if st is None else self._blocks.get(st)

    def finish(self) -> None:
        """End the region: the peak is settled, and frees from now on are not counted."""
        self._reread()
        self._settle_peak()
        self.finished = True

    def _transient(self, nbytes: int, workspace: bool = False) -> int:
        """A backend's buffer (or a kernel's ``workspace``), alive from now until ``_freed`` is given the key this
        returns."""
        block = _Block(nbytes, self.phase)
        block.is_comm, block.is_workspace = not workspace, workspace
        self._live[id(block)] = block
        self._add(nbytes)
        return id(block)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        collective = func.namespace in _COLLECTIVES
        if self._source is not None and collective:
            self._refresh()
        if self._followed:
            self._reread()
        if any(issubclass(t, dtensor_class()) for t in types):
            # DTensor runs the operator with this trace still on: its local operators are seen, and the
            # redistributions of its inputs (an all-gather's output, alive while the local operator runs) with them
            return NotImplemented
        nbytes = self._collective_buffers(func, args) if self._collective_buffers is not None else 0
        buffer = self._transient(nbytes) if nbytes else None  # the key of the backend's buffer
        inside = self._workspaces(func, args, kwargs or {}) if self._workspaces is not None else 0
        workspace = self._transient(inside, workspace=True) if inside else None
        out = func(*args, **(kwargs or {}))
        if collective:
            self.collective_bytes += max(_nbytes(args), _nbytes(out))
        if self.count_flops and func._overloadpacket in flop_registry:
            # FlopCounterMode's own formulas, without its module tracker: its autograd hooks keep a checkpointed
            # block's recomputed tensors alive (measured: a planned peak twice as large)
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        for t in tree_iter(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        for key in (buffer, workspace):  # alive with the outputs, as calibrated (the peak inside, outputs made)
            if key is not None:
                self._freed(key)
        return out

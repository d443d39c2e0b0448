"""The first stepping backward: how buckets are learned from the order gradients arrive in.

A parameter with no bucket yet joins the bucket being learned, which is closed (and settled at once: all its
gradients came in this backward) when the next gradient would not fit in the cap, when it is full, or when the
next gradient leaves the shared buffer the last one lives in (an FSDP2 unit's reduce-scatter output). Gradients one
autograd node computes together start the next bucket together. The graph is looked at once, from the backward's
roots, to find those nodes, and a model compiled whole (every gradient from one node) or a reentrant checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from dist_optim._torch_internals import FORWARD_CLS, is_fake
from dist_optim.engine._buckets import Backward
from dist_optim.engine._guards import REENTRANT_CHECKPOINT
from dist_optim.engine._inputs import is_dtensor

__all__: list[str] = []


class Host(Protocol):
    """What the learner reads of the engine it learns for, and the two calls it makes back."""

    params: list[torch.Tensor]
    nbytes: list[int]  # per parameter: its (local) gradient's bytes
    index_of: dict[int, int]  # id(param) -> index
    cap_bytes: int
    per_parameter: bool
    sparse: set[int]  # the learner adds the parameters whose gradients it finds sparse

    def check_later_hooks(self, i: int, bw: Backward) -> None:
        """Parameter ``i`` completes a bucket inside its own hook: name a hook registered after it (once)."""

    def close_learned(self, indices: list[int], bw: Backward) -> None:
        """Build, record and settle the bucket of ``indices``, all of whose gradients arrived in ``bw``."""


class Learner:
    """Learns one engine's buckets; what it found in the graph is kept for the backwards after."""

    __slots__ = ("engine", "graph_read", "at_once_bytes", "computed_with")

    def __init__(self, engine: Host) -> None:
        self.engine = engine
        self.graph_read = False  # whether the gradients' producers were looked at (once, in a stepping backward)
        self.at_once_bytes = 0  # gradient bytes that one autograd node hands over at once (whole-model compile)
        self.computed_with: dict[int, int] = {}  # param index -> a label of the autograd node that computes its
        # gradient together with its siblings' (from the first stepping backward's graph; empty if not found)

    def learn(self, i: int, bw: Backward) -> None:
        """Parameter ``i``, which has no bucket yet, got its gradient in ``bw``."""
        engine = self.engine
        p = engine.params[i]
        if p.grad is not None and p.grad.is_sparse:
            engine.sparse.add(i)
        nbytes = engine.nbytes[i]
        if bw.learning and (bw.learning_bytes + nbytes > engine.cap_bytes  # a tensor that does not fit starts the next
                            or _leaves_shared_buffer(engine.params[bw.learning[-1]].grad, p.grad)):
            self.close(bw, self._computed_with_last(bw.learning, i))
        bw.learning.append(i)
        bw.learning_bytes += nbytes
        if engine.per_parameter or bw.learning_bytes >= engine.cap_bytes:
            engine.check_later_hooks(i, bw)
            self.close(bw)

    def close(self, bw: Backward, carry: int = 0) -> None:
        """Close the bucket being learned but for its last ``carry`` tensors, which start the next one (all of
        them: nothing closes), and settle it."""
        if carry >= len(bw.learning):
            return
        engine = self.engine
        indices = bw.learning[:len(bw.learning) - carry]
        bw.learning = bw.learning[len(indices):]
        bw.learning_bytes = sum(engine.nbytes[j] for j in bw.learning)
        engine.close_learned(indices, bw)  # every gradient of a learned bucket arrived in this backward

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

    def read_graph(self, roots: list[torch.Tensor]) -> bool:
        """Once: which node computes each parameter's gradient, and whether one autograd node hands over the
        gradients of every parameter (a model compiled whole, whose compiled backward returns them together):
        then they are all alive at once and buckets save nothing. Returns whether the graph holds a reentrant
        checkpoint segment (nothing else is looked at then, and the next stepping backward looks again)."""
        index_of = self.engine.index_of
        producers: dict[object, list[int]] = {}
        parents: dict[object, list[object]] = {}
        seen: set[int] = set()
        stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if getattr(node, FORWARD_CLS, None) is REENTRANT_CHECKPOINT:
                return True
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    i = index_of.get(id(var))
                    if i is not None:
                        producers.setdefault(node, []).append(i)
                else:
                    parents.setdefault(nxt, []).append(node)
                    stack.append(nxt)
        self.graph_read = True
        self.computed_with = _computing_nodes(producers, parents)
        if len(producers) != 1:
            return False
        (indices,) = producers.values()
        total = sum(self.engine.nbytes[i] for i in set(indices))
        if len(indices) < 2 or total <= self.engine.cap_bytes:
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
    # a fake tensor (the memory planner's) has no address: its storage object stands for it (one per storage)
    where = id(storage) if is_fake(local) else storage.data_ptr()
    return where, storage.nbytes() > local.numel() * local.element_size()


def _leaves_shared_buffer(last: torch.Tensor | None, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` lives in another storage than ``last``, a view of a shared buffer. FSDP2 hands each
    ``fully_shard`` unit's sharded gradients over as views of one reduce-scatter output, which stays alive while any
    of them does: a bucket that ran on into the next unit would hold the whole buffer of the one before (bytes the
    cap does not count) through the next reduce-scatter. Closed here, a bucket never spans two units, and from the
    second backward on each unit's last bucket steps at the unit's last gradient, inside its reduction."""
    a, b = _storage(last), _storage(grad)
    return a is not None and a[1] and b is not None and b[0] != a[0]


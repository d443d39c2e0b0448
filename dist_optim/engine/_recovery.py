"""A backward that never reached its end (it raised, was interrupted, or its callback was lost): what it left.

The engine calls :func:`recover` as the next backward begins, before anything of that backward is stepped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from dist_optim.engine._buckets import Backward, Bucket

__all__: list[str] = []


def recover(last: Backward, first: int | None, params: list[torch.Tensor], buckets: list[Bucket],
            bucket_of: list[Bucket | None], name: Callable[[torch.Tensor], str]) -> None:
    """The backward ``last`` never reached its end (it raised, was interrupted, or its callback was lost): its
    partial buckets are forgotten and, if it stepped, the gradients it left are dropped, so that this backward
    does not step on them. ``first``'s gradient already holds this backward's part too: dropped if it may
    hold a stale one."""
    mixed = last.run.steps and not last.cleared and first is not None and (
        first in last.learning or any(first in b.indices for b, _ in last.held)
        or (bucket_of[first] is not None and _was_partial(bucket_of[first], last))
    )
    for b in buckets:
        b.arrived = 0
    if not last.run.steps:
        return  # a micro-batch that only accumulates: as in the standard loop, .grad keeps what it got
    dropped = 0
    for i, p in enumerate(params):
        if p.grad is not None and not last.cleared and (i != first or mixed):
            p.grad = None
            dropped += 1
    if not (dropped or last.tensors_stepped):
        return
    stepped = (
        f"{last.tensors_stepped} tensors had already been stepped on its batch and the others not "
        "(opt.step_incomplete is True: the model holds a half-applied step; to recover exactly, reload the last "
        "checkpoint), and " if last.tensors_stepped else ""
    )
    first_note = (
        f" (including {name(params[first])}, whose gradient from this backward had been "
        "added onto its stale one, so it is not stepped in this one)" if mixed else ""
    )
    warnings.warn(
        f"the previous backward did not finish (it raised or was interrupted before its end): {stepped}"
        f"{dropped} tensors' gradients left from it were dropped{first_note}, so that this backward does not "
        "step on them. See docs/limitations.md, 'A backward that raises'",
        RuntimeWarning,
        stacklevel=4,
    )


def _was_partial(b: Bucket, last: Backward) -> bool:
    """Whether ``b`` was left half-arrived (or held) by ``last``, a backward that did not end."""
    return b.arrived > 0 or any(b is held for held, _ in last.held)

"""Who steps a parameter in backward: a gradient can be consumed once, so two owners of one parameter are refused.

The registry is keyed weakly by parameter and its values never refer to their key, so it keeps nothing alive (what
keeps an owner alive is the parameter itself: the engine's link, the seed pair's list); the hooks of an owner that
was dropped (the seed pair's list replaced by hand) are detached when a new owner claims the parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

__all__: list[str] = []

# param -> (weakref to what steps it in backward, its hook's handle). The value never refers to its key (a handle
# holds its hooks dict weakly), so the map keeps nothing alive.
_OWNERS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def check_unowned(params: Iterable[torch.Tensor], owner: object, describe: Callable[[torch.Tensor], str]) -> None:
    """Refuse a parameter that another live owner steps in backward; detach the hooks of dead owners."""
    for p in params:
        entry = _OWNERS.get(p)
        if entry is None:
            continue
        other = entry[0]()
        if other is None:
            if entry[1] is not None:
                entry[1].remove()
            del _OWNERS[p]
        elif other is not owner:
            raise ValueError(
                f"parameter {describe(p)} is already stepped in backward by {type(other).__name__} at "
                f"{hex(id(other))}; a gradient can be consumed only once. Put it in one optimizer (param groups "
                "may carry their own 'optimizer_class'), or call .remove() on the other one first"
            )


def is_owned(p: torch.Tensor) -> bool:
    """Whether a live owner steps ``p`` in backward."""
    entry = _OWNERS.get(p)
    return entry is not None and entry[0]() is not None


def record_owner(p: torch.Tensor, owner: object, handle: RemovableHandle | None) -> None:
    _OWNERS[p] = (weakref.ref(owner), handle)


def release(params: Iterable[torch.Tensor], owner: object) -> None:
    for p in params:
        entry = _OWNERS.get(p)
        if entry is not None and entry[0]() is owner:
            del _OWNERS[p]

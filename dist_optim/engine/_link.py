"""How a parameter reaches its engine: a :class:`Link` in the parameter's own ``__dict__``, and one hook function.

The link keeps the engine alive as long as the parameter is (so an optimizer lives as long as the parameters it
steps), in the ``__dict__`` where the garbage collector sees it; the hook takes the parameter and closes over
nothing, so no cycle runs through torch's C++ hook dicts and dropping model and optimizer frees both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__: list[str] = []

LINK = "_in_backward_engine"  # the key in a parameter's __dict__


class Link:
    """What a parameter holds in its ``__dict__``: its engine (kept alive by it) and its index there. A copy or a
    pickle of the parameter carries an empty ``OrderedDict`` instead (``torch.load(weights_only=True)`` accepts
    it): the copy is not stepped, as torch's hooks are not copied either."""

    __slots__ = ("engine", "index")

    def __init__(self, engine: Any, index: int) -> None:
        self.engine = engine
        self.index = index

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return OrderedDict, ()

    def __deepcopy__(self, memo: dict[int, object]) -> OrderedDict:
        return OrderedDict()


def engine_of(param: torch.Tensor) -> Any:
    """The engine that steps ``param`` in backward, or ``None``."""
    link = param.__dict__.get(LINK)
    return link.engine if isinstance(link, Link) else None


def grad_accumulated(param: torch.Tensor) -> None:
    # The one hook of every parameter: it reaches the engine through the parameter, so it holds nothing itself.
    link = param._in_backward_engine
    link.engine.grad_ready(link.index)

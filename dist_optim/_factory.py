"""``in_backward(optimizer_class, **engine_options)``: an optimizer *class* that steps in backward.

Config systems (HF ``optimizer_cls_and_kwargs``, Lightning CLI, torchtune ``_component_``, hydra) build an optimizer
from a class and its keyword arguments, ``cls(params, **kwargs)``. This module makes such a class for
``InBackwardOptimizer`` with one wrapped optimizer class and fixed engine options.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dist_optim.engine._inputs import check_optimizer_class
from dist_optim.optimizer import InBackwardOptimizer

__all__: list[str] = []


def engine_option_names() -> frozenset[str]:
    """The keyword-only options of ``InBackwardOptimizer`` (no torch optimizer uses these names)."""
    signature = inspect.signature(InBackwardOptimizer.__init__)
    return frozenset(n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)


def in_backward(optimizer_class: type[torch.optim.Optimizer], **engine_options: Any) -> type[InBackwardOptimizer]:
    """An ``InBackwardOptimizer`` subclass built as ``cls(params, **optimizer_kwargs)``, like ``optimizer_class``.

    Args:
        optimizer_class: the optimizer to step in backward, e.g. ``torch.optim.AdamW``.
        **engine_options: ``InBackwardOptimizer``'s engine options (``bucket_cap_mb``, ``max_grad_norm``, ...),
            fixed for every instance; an instance may still override one by name.

    Returns:
        A subclass of :class:`InBackwardOptimizer` named ``InBackward<optimizer_class name>`` whose ``__init__``
        takes ``(params, **optimizer_kwargs)``; its class attributes ``optimizer_class`` and ``engine_options``
        say what it was made from.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or an engine option name is unknown (an option
            of the wrapped optimizer, such as ``lr``, belongs in the call that builds an instance).

    Example:
        >>> import functools, torch, dist_optim
        >>> InBackwardAdamW = dist_optim.in_backward(torch.optim.AdamW, bucket_cap_mb=1.0)
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = InBackwardAdamW(model.parameters(), lr=1e-2, fused=True)
        >>> isinstance(opt, dist_optim.InBackwardOptimizer), opt.param_groups[0]["lr"]
        (True, 0.01)
        >>> model(torch.randn(8, 4)).sum().backward()  # stepped in here
        >>> model.weight.grad is None
        True
    """
    check_optimizer_class(optimizer_class)
    known = engine_option_names()
    unknown = sorted(set(engine_options) - known)
    if unknown:
        raise TypeError(
            f"in_backward() got option(s) {', '.join(unknown)} that are not engine options of InBackwardOptimizer "
            f"(those are: {', '.join(sorted(known))}); pass the options of {optimizer_class.__name__} when "
            "building an instance: cls(params, lr=...)"
        )
    fixed = dict(engine_options)

    def __init__(self: InBackwardOptimizer, params: Any, **optimizer_kwargs: Any) -> None:
        InBackwardOptimizer.__init__(self, params, optimizer_class, **{**fixed, **optimizer_kwargs})

    name = f"InBackward{optimizer_class.__name__}"
    options = ", ".join(f"{k}={v!r}" for k, v in sorted(fixed.items()))
    doc = (
        f"``InBackwardOptimizer(params, {optimizer_class.__module__}.{optimizer_class.__qualname__}"
        f"{', ' if options else ''}{options}, **optimizer_kwargs)``, made by ``dist_optim.in_backward``."
    )
    return type(name, (InBackwardOptimizer,), {"__init__": __init__, "__doc__": doc, "__module__": __name__,
                                                "optimizer_class": optimizer_class, "engine_options": dict(fixed)})

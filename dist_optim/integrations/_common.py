"""What every framework adapter needs: find the ``InBackwardOptimizer`` behind a framework's optimizer wrapper,
accumulate without stepping, and check a clipping request made after backward against what the optimizer did."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dist_optim.optimizer import InBackwardOptimizer

__all__: list[str] = []


def unwrap(optimizer: Any) -> InBackwardOptimizer | None:
    """The ``InBackwardOptimizer`` inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: both expose the wrapped one as ``.optimizer``), or ``None``."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, InBackwardOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


@contextlib.contextmanager
def accumulating(optimizers: Iterable[InBackwardOptimizer]) -> Iterator[None]:
    """Backwards in here only accumulate into ``.grad`` for every optimizer given (``opt.no_step()`` on each)."""
    with contextlib.ExitStack() as stack:
        for opt in optimizers:
            stack.enter_context(opt.no_step())
        yield


def owner_of(params: Iterable[torch.Tensor], optimizers: Iterable[InBackwardOptimizer]) -> InBackwardOptimizer | None:
    """The in-backward optimizer that steps ``params``; ``None`` if none of them is stepped in backward.

    Raises:
        ValueError: ``params`` mixes tensors stepped in backward with others, or is a part of an optimizer's
            tensors: a norm over a part is not the norm the optimizer clips with.
    """
    params = [p for p in params if p.requires_grad]
    ids = {id(p) for p in params}
    for opt in optimizers:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        if not ids & owned:
            continue
        if ids != owned:
            raise ValueError(
                f"clipping was asked for {len(ids)} tensors, of which {len(ids & owned)} are stepped in backward by an "
                f"InBackwardOptimizer that steps {len(owned)}: the optimizer clips all of its tensors together. Pass "
                "exactly the optimizer's parameters (model.parameters() when it steps the whole model)"
            )
        return opt
    return None


def check_norm_clip(opt: InBackwardOptimizer, max_norm: float, norm_type: float, caller: str) -> torch.Tensor:
    """``caller`` asked to clip ``opt``'s gradients by norm after backward, where the step already ran: it is
    exact only if ``opt`` clipped in the same way inside backward (``"exact"`` or ``"two_pass"``). Returns the norm ``clip_grad_norm_`` would have
    returned. ``max_norm=inf`` only measures, whatever ``opt`` clips with."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    measuring = math.isinf(max_norm)
    if not measuring and (opt.max_grad_norm != max_norm or opt.clip_mode not in ("exact", "two_pass")):
        raise ValueError(
            f"{caller}(max_norm={max_norm}) runs after backward, where the InBackwardOptimizer has already stepped "
            f"with max_grad_norm={opt.max_grad_norm}, clip_mode={opt.clip_mode!r}: the clipping must be set on the "
            f"optimizer before the backward: InBackwardOptimizer(..., max_grad_norm={max_norm}) or "
            f"opt.configure_clipping(max_grad_norm={max_norm}, clip_mode='exact')"
        )
    if opt.grad_norm_type != norm_type:
        raise ValueError(
            f"{caller}(norm_type={norm_type}) asks for another norm than the optimizer measures "
            f"(grad_norm_type={opt.grad_norm_type}); set grad_norm_type={norm_type} on the optimizer"
        )
    norm = opt.grad_norm
    if norm is None:
        raise ValueError(
            f"{caller}() asks for the gradient norm, which this InBackwardOptimizer does not measure; build it with "
            "track_grad_norm=True (or a max_grad_norm)"
        )
    return norm


def check_value_clip(opt: InBackwardOptimizer, clip_value: float, caller: str) -> None:
    """As :func:`check_norm_clip`, for ``clip_grad_value_``."""
    if opt.max_grad_value != float(clip_value):
        raise ValueError(
            f"{caller}(clip_value={clip_value}) runs after backward, where the InBackwardOptimizer has already "
            f"stepped with max_grad_value={opt.max_grad_value}: set it on the optimizer before the backward: "
            f"InBackwardOptimizer(..., max_grad_value={clip_value}) or opt.configure_clipping(max_grad_value="
            f"{clip_value})"
        )


def clipping_options(value: float | None, algorithm: str, opt: InBackwardOptimizer) -> dict[str, Any]:
    """``configure_clipping`` options for a framework's ``(clip value, "norm" | "value")`` setting: clipping by
    norm is exact, in ``opt``'s ``"two_pass"`` mode where it was built with it, else ``"exact"``."""
    if not value:
        return dict(max_grad_norm=None, max_grad_value=None)
    if algorithm == "norm":
        mode = "two_pass" if opt.clip_mode == "two_pass" else "exact"
        return dict(max_grad_norm=float(value), clip_mode=mode, max_grad_value=None)
    if algorithm == "value":
        return dict(max_grad_norm=None, max_grad_value=float(value))
    raise NotImplementedError(f"gradient clipping algorithm {algorithm!r} has no in-backward equivalent; use 'norm' "
                              "or 'value'")

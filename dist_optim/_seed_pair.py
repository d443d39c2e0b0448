"""The seed-compatible pair: ``apply_optimizer_in_backward`` and ``get_in_backward_optimizers``.

Same behaviour and layout as torch's private ``_apply_optimizer_in_backward`` (optimizers over the parameter
itself in ``param._in_backward_optimizers``, several per parameter, shared parameters, ``register_hook=False``),
without its leak: everything lives in the parameter's own ``__dict__``, where the garbage collector sees the
cycle, and the hook takes the parameter as its argument instead of closing over it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from dist_optim._inputs import check_optimizer_class, check_single_process, check_tensor
from dist_optim._owners import check_unowned, record_owner

__all__: list[str] = []


class _InBackwardOptimizers(list):
    """``param._in_backward_optimizers``: a list as in torch, weak-referenceable so it can own the parameter's
    gradient in the owner registry (a plain list cannot be weakly referenced), with the handle of its hook."""

    handle: RemovableHandle | None = None

    def hooked(self) -> bool:
        hooks = self.handle.hooks_dict_ref() if self.handle is not None else None
        return hooks is not None and self.handle.id in hooks


def _make_hook(allow_local_steps: bool):
    # Closes over a bool only: a hook that held the parameter or its optimizers would keep the model alive from
    # the autograd graph, which is torch's leak.
    def step_in_backward(param: torch.Tensor) -> None:
        if not allow_local_steps:
            check_single_process(False, [param])  # a process group may have appeared since (then DDP-wrapped)
        for opt in param._in_backward_optimizers:
            opt.step()
        param.grad = None

    return step_in_backward


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: dict[str, Any],
    register_hook: bool = True,
    *,
    allow_local_steps: bool = False,
) -> None:
    """Give each parameter its own ``optimizer_class`` instance, stepped as soon as its gradient is accumulated.

    A drop-in for torch's private ``torch.distributed.optim._apply_optimizer_in_backward``: the optimizers are
    appended to ``param._in_backward_optimizers`` (classes and options to ``param._optimizer_classes`` and
    ``param._optimizer_kwargs``), as torch does; call it several times to attach several optimizers to a parameter
    (each steps once per backward, in the order attached); after ``backward()`` the gradients are ``None``.
    Unlike torch's, it frees the parameters when the model is dropped and refuses, instead of training on local
    gradients, to step plain parameters in a multi-rank job. For bucketed, faster steps and a single
    ``state_dict()``, use :class:`InBackwardOptimizer`.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.
        params: the parameters (leaf tensors that require grad).
        optimizer_kwargs: options for ``optimizer_class``.
        register_hook: if ``False``, only record the optimizers (for :func:`get_in_backward_optimizers`); nothing
            steps in backward unless another call on the same parameter registers the hook.
        allow_local_steps: in a multi-rank job, step on local, un-reduced gradients (local SGD).

    Example:
        >>> import torch, dist_optim
        >>> model = torch.nn.Linear(3, 1)
        >>> dist_optim.apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        >>> model(torch.ones(2, 3)).sum().backward()
        >>> opt = model.weight._in_backward_optimizers[0]
        >>> model.weight.grad is None, opt.param_groups[0]["params"][0] is model.weight
        (True, True)
    """
    check_optimizer_class(optimizer_class)
    params = list(params)
    for k, p in enumerate(params):
        check_tensor(p, f"params[{k}]")
    check_single_process(allow_local_steps, params)
    if register_hook:
        for p in params:
            check_unowned([p], p.__dict__.get("_in_backward_optimizers"), lambda t: f"of shape {tuple(t.shape)}")
    optimizers = [optimizer_class([p], **optimizer_kwargs) for p in params]  # all options checked before any change
    for p, opt in zip(params, optimizers):
        if not isinstance(p.__dict__.get("_in_backward_optimizers"), _InBackwardOptimizers):
            # a list left by torch's own function is kept, in order, under our type
            p._in_backward_optimizers = _InBackwardOptimizers(p.__dict__.get("_in_backward_optimizers", []))
            p._optimizer_classes = p.__dict__.get("_optimizer_classes", [])
            p._optimizer_kwargs = p.__dict__.get("_optimizer_kwargs", [])
        p._in_backward_optimizers.append(opt)
        p._optimizer_classes.append(optimizer_class)
        p._optimizer_kwargs.append(optimizer_kwargs)
        if register_hook and not p._in_backward_optimizers.hooked():
            owner = p._in_backward_optimizers
            owner.handle = p.register_post_accumulate_grad_hook(_make_hook(allow_local_steps))
            record_owner(p, owner, owner.handle)


def get_in_backward_optimizers(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers :func:`apply_optimizer_in_backward` attached to ``module``'s parameters, in parameter order
    (each parameter's in the order attached), as torch's ``_get_in_backward_optimizers``.

    They are real optimizers over the module's own parameters: pass them to
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(module, optimizers)``; do not call their
    ``step()`` after a backward, which already stepped and cleared the gradient.

    Args:
        module: the model.

    Returns:
        A list of optimizers (empty if none were attached).
    """
    return [opt for p in module.parameters() for opt in getattr(p, "_in_backward_optimizers", [])]

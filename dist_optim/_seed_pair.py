"""The seed-compatible pair: ``apply_optimizer_in_backward`` and ``get_in_backward_optimizers``.

Same behaviour as torch's private ``_apply_optimizer_in_backward`` (one optimizer instance per parameter, several
optimizers per parameter, shared parameters, ``register_hook=False``), without its leak: the per-parameter record
lives in a weak-keyed map and its optimizers hold a detached alias of the parameter, never the parameter itself,
so dropping the model frees everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from dist_optim._inputs import check_optimizer_class, check_single_process, check_tensor, is_dtensor
from dist_optim._owners import check_unowned, record_owner

__all__: list[str] = []

_RECORDS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


class _Record:
    __slots__ = ("alias", "optimizers", "handle", "__weakref__")

    def __init__(self, param: torch.Tensor) -> None:
        self.alias = param.detach()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.handle: RemovableHandle | None = None

    def refresh(self, param: torch.Tensor) -> None:
        """Follow ``param.data = ...`` (e.g. ``module.to()``): point the optimizers at the new storage."""
        old, new = self.alias, param.detach()
        for opt in self.optimizers:
            opt.param_groups[0]["params"][0] = new
            if old in opt.state:
                opt.state[new] = opt.state.pop(old)
        self.alias = new


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if is_dtensor(t) else t).data_ptr()  # a DTensor's own data_ptr() is 0


def _make_hook(record: _Record, allow_local_steps: bool):
    def hook(param: torch.Tensor) -> None:
        if not allow_local_steps:
            check_single_process(False, [param])  # a process group may have appeared since (then DDP-wrapped)
        alias = record.alias
        if _storage(alias) != _storage(param) or alias.dtype != param.dtype:
            record.refresh(param)
            alias = record.alias
        alias.grad = param.grad
        try:
            for opt in record.optimizers:
                opt.step()
        finally:
            alias.grad = None
        param.grad = None

    return hook


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: dict[str, Any],
    register_hook: bool = True,
    *,
    allow_local_steps: bool = False,
) -> None:
    """Give each parameter its own ``optimizer_class`` instance, stepped as soon as its gradient is accumulated.

    A drop-in for torch's private ``torch.distributed.optim._apply_optimizer_in_backward``: call it several times
    to attach several optimizers to a parameter (each steps once per backward, in the order attached); after
    ``backward()`` the gradients are ``None``. Unlike torch's, it frees the parameters when the model is dropped
    and refuses, instead of training on local gradients, to run in a multi-rank job. For bucketed, faster steps
    and a single ``state_dict()``, use :class:`InBackwardOptimizer`.

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
        >>> model.weight.grad is None, len(dist_optim.get_in_backward_optimizers(model))
        (True, 2)
    """
    check_optimizer_class(optimizer_class)
    params = list(params)
    for k, p in enumerate(params):
        check_tensor(p, f"params[{k}]")
    check_single_process(allow_local_steps, params)
    if register_hook:
        for p in params:
            check_unowned([p], _RECORDS.get(p), lambda t: f"of shape {tuple(t.shape)}")
    for p in params:
        record = _RECORDS.get(p)
        if record is None:
            record = _RECORDS[p] = _Record(p)
        record.optimizers.append(optimizer_class([record.alias], **optimizer_kwargs))
        if register_hook and record.handle is None:
            record.handle = p.register_post_accumulate_grad_hook(_make_hook(record, allow_local_steps))
            record_owner(p, record, record.handle)


def get_in_backward_optimizers(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers :func:`apply_optimizer_in_backward` attached to ``module``'s parameters, in parameter order.

    They are real optimizers (``state_dict()``, ``param_groups``) over a detached alias of each parameter, which
    shares its storage; do not call their ``step()``, backward does.

    Args:
        module: the model.

    Returns:
        A list of optimizers (empty if none were attached).
    """
    return [opt for p in module.parameters() if p in _RECORDS for opt in _RECORDS[p].optimizers]

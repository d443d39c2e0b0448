"""The seed-compatible pair: ``apply_optimizer_in_backward`` and ``get_in_backward_optimizers``.

Same behaviour and layout as torch's private ``_apply_optimizer_in_backward`` (optimizers over the parameter
itself in ``param._in_backward_optimizers``, several per parameter, shared parameters, ``register_hook=False``),
without its leak: the optimizers live in the parameter's own ``__dict__``, where the garbage collector sees the
cycle, and the hook takes the parameter as its argument instead of closing over it; the hook's handle is kept off
the parameter, in a weak map (the ``__dict__`` travels with a pickled module). Under DDP, torch's own
communication hook steps these optimizers where the build allows it; under FSDP1 (``use_orig_params=True``), FSDP1's
runtime steps them after its reduce-scatter (our hook never fires there: the original parameters are not in the
autograd graph, the flat parameter is).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from dist_optim._torch_internals import FSDP_FLATTENED, flat_parameter_class
from dist_optim.engine._inputs import check_optimizer_class, check_tensor, is_dtensor
from dist_optim.engine._owners import check_unowned, record_owner

__all__: list[str] = []


class _InBackwardOptimizers(list):
    """``param._in_backward_optimizers``: a list as in torch, weak-referenceable so it can own the parameter's
    gradient in the owner registry (a plain list cannot be weakly referenced)."""


# param -> the handle of its hook. A handle refers to its hooks weakly, so the map keeps nothing alive; it stays
# off the parameter, whose __dict__ travels with a pickled module.
_HANDLES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _hooked(p: torch.Tensor) -> bool:
    handle = _HANDLES.get(p)
    hooks = handle.hooks_dict_ref() if handle is not None else None
    return hooks is not None and handle.id in hooks


def _make_hook(allow_local_steps: bool):
    # Closes over a bool only: a hook that held the parameter or its optimizers would keep the model alive from
    # the autograd graph, which is torch's leak.
    def step_in_backward(param: torch.Tensor) -> None:
        if not allow_local_steps and _world(param) > 1:
            raise RuntimeError(_local_gradient_message(param))
        for opt in param._in_backward_optimizers:
            opt.step()
        param.grad = None

    return step_in_backward


def _world(p: torch.Tensor) -> int:
    """The number of ranks whose gradients meet at this parameter's hook only if something reduces them first:
    1 in a single process, for DTensor parameters (FSDP2 reduce-scatters before their hooks) and for FSDP1's
    original parameters (``use_orig_params=True``), whose optimizers FSDP1 steps itself after its reduce-scatter."""
    dist = torch.distributed
    if is_dtensor(p) or _fsdp1_original(p) or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _fsdp1_original(p: torch.Tensor) -> bool:
    """An original parameter of an FSDP1 ``FullyShardedDataParallel(use_orig_params=True)`` module: FSDP1 marks the
    parameters it flattens (torch's ``FSDP_FLATTENED``; a torch that stops doing so is caught by
    tests/test_torch_internals.py, and by tests/test_seed_pair_dist.py, whose wrap-then-attach case is then
    refused). The ``FlatParameter`` itself (``use_orig_params=False``) is not one: torch refuses optimizers in
    backward on it."""
    if not getattr(p, FSDP_FLATTENED, False):
        return False
    return not isinstance(p, flat_parameter_class())


def _ddp_can_take_over() -> bool:
    """Whether torch's DDP can step these optimizers: it does so for parameters that carry
    ``_in_backward_optimizers`` (all-reduce, average, step each one, in its communication hook), but the callback
    that hook queues for the end of backward calls ``torch.accelerator.current_stream()``, which raises on a
    build without an accelerator, after the step."""
    return torch.accelerator.is_available()


def _ddp_alternative(p: torch.Tensor) -> str:
    return (
        f"a process group with {_world(p)} ranks is initialised: each rank's hook would see its local, un-reduced "
        "gradient unless DistributedDataParallel takes the step over, and on this build without an accelerator "
        "torch's DDP cannot step optimizers attached by apply_optimizer_in_backward (its end-of-backward callback "
        "calls torch.accelerator.current_stream(), which raises after the step). Wrap "
        "the model in DDP and use dist_optim.InBackwardOptimizer(ddp_model, optimizer_class, **optimizer_kwargs), "
        "which steps in backward after each bucket's all-reduce; or wrap it in FSDP1 "
        "(FullyShardedDataParallel(use_orig_params=True)) first and attach after wrapping: FSDP1 steps these "
        "optimizers itself after its reduce-scatter; or pass allow_local_steps=True if local steps without a "
        "wrapper are what you want (local SGD)"
    )


def _local_gradient_message(p: torch.Tensor) -> str:
    if not _ddp_can_take_over():
        return _ddp_alternative(p) + "; nothing was stepped"
    return (
        f"a parameter of shape {tuple(p.shape)} would be stepped on its local, un-reduced gradient in a job of "
        f"{_world(p)} ranks: DistributedDataParallel did not take it over (the model is not DDP-wrapped, or the "
        "parameter is in DDP's params_and_buffers_to_ignore), so the replicas would drift apart. Wrap the model "
        "in DDP before its first forward, or pass allow_local_steps=True for the parameters that should step "
        "locally (DDP's standard loop steps ignored parameters on their local gradients too)"
    )


def _register_for_ddp(p: torch.Tensor, handle: RemovableHandle) -> None:
    """List the hook where torch's DDP looks for the hooks it replaces with its own step after the all-reduce
    (``param_to_optim_hook_handle_map``, read at DDP's first forward), on builds where that step works."""
    if torch.distributed.is_available() and _ddp_can_take_over():
        from torch.distributed.optim.apply_optimizer_in_backward import (
            param_to_optim_hook_handle_map,
        )

        param_to_optim_hook_handle_map.setdefault(p, []).append(handle)


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
    Unlike torch's, it frees the parameters when the model is dropped and never steps on local gradients
    unasked. Under DistributedDataParallel (attach before or after wrapping, before the first forward), torch's
    DDP takes the step over after each bucket's all-reduce, as with torch's function; that step needs an
    accelerator build. Under FSDP1 (``use_orig_params=True``), torch's FSDP1 steps them after its reduce-scatter,
    whether they were attached before or after wrapping, and before or after ``init_process_group``. What steps
    them is known only when their gradients arrive: in a multi-rank job a gradient that reaches the hook
    un-reduced (no wrapper took the step over: not wrapped, or DDP on a build without an accelerator) is refused
    there, before anything steps, naming the way out (``InBackwardOptimizer(ddp_model, ...)``). For bucketed,
    faster steps and a single ``state_dict()``, use :class:`InBackwardOptimizer`.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.
        params: the parameters (leaf tensors that require grad).
        optimizer_kwargs: options for ``optimizer_class``.
        register_hook: if ``False``, only record the optimizers (for :func:`get_in_backward_optimizers`); nothing
            steps in backward unless another call on the same parameter registers the hook.
        allow_local_steps: in a multi-rank job, step the parameters DDP does not take over (not wrapped, or in
            DDP's ignore list) on their local, un-reduced gradients (local SGD).

    Raises:
        RuntimeError: at the first backward, before anything steps, in a multi-rank job whose gradient reached a
            parameter's hook un-reduced (no wrapper took the step over), unless ``allow_local_steps``.

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
    if register_hook:
        for p in params:
            check_unowned([p], p.__dict__.get("_in_backward_optimizers"), lambda t: f"of shape {tuple(t.shape)}")
    if torch.distributed.is_available():
        # DDP's first forward reads torch.distributed.optim.apply_optimizer_in_backward as an attribute of
        # torch.distributed when a parameter carries _in_backward_optimizers; it exists once the module is imported
        importlib.import_module("torch.distributed.optim")
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
        if register_hook and not _hooked(p):
            handle = _HANDLES[p] = p.register_post_accumulate_grad_hook(_make_hook(allow_local_steps))
            record_owner(p, p._in_backward_optimizers, handle)
            _register_for_ddp(p, handle)


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

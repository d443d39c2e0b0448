"""What the user passes in: checks that refuse bad input at construction, naming the value and the fix.

Optimizer classes, tensors, modules (frozen parameters skipped, wrappers not supported yet refused) and the
multi-rank guard that keeps plain hooks from stepping on un-reduced gradients.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from typing import Any

import torch
from torch import nn

from dist_optim import _torch_internals as internals

__all__: list[str] = []

logger = logging.getLogger(__name__)


NOT_GIVEN: Any = object()  # InBackwardOptimizer's params and optimizer_class are required; a clear error says so


def check_given(params: bool, optimizer_class: bool) -> None:
    """Refuse ``InBackwardOptimizer()`` called without ``params`` or ``optimizer_class`` (whether each was given)."""
    if params and optimizer_class:
        return
    missing = " and ".join(n for n, given in (("params", params), ("optimizer_class", optimizer_class)) if not given)
    raise TypeError(
        f"InBackwardOptimizer() got no {missing}: it is built as InBackwardOptimizer(params, optimizer_class, "
        "**options). A framework that calls a factory without arguments (HF Trainer's "
        "optimizer_cls_and_kwargs=(functools.partial(InBackwardOptimizer, ...), ...)) needs an optimizer "
        "class instead: dist_optim.in_backward(torch.optim.AdamW, **engine_options)"
    )


def check_optimizer_class(optimizer_class: Any) -> None:
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_class must be an optimizer class, got an instance of {type(optimizer_class).__name__}; "
            f"pass the class and its options, e.g. InBackwardOptimizer(params, torch.optim."
            f"{type(optimizer_class).__name__}, lr=...)"
        )
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a subclass of torch.optim.Optimizer, got {optimizer_class!r}; "
            "pass a class such as torch.optim.AdamW"
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_class.__name__} needs a closure that re-evaluates the loss, which cannot run inside "
            "backward; use it with a standard training loop"
        )


def check_tensor(p: Any, name: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"optimizer can only optimize Tensors, but {name} is a {torch.typename(p)}")
    if not p.is_leaf:
        raise ValueError(
            f"can't optimize a non-leaf Tensor ({name}); pass leaf tensors such as nn.Parameter, or call "
            ".detach().requires_grad_() on it"
        )
    if p.is_meta:
        raise ValueError(
            f"{name} is on the meta device: it has no data, and once the model is materialised (to_empty(), "
            "loading weights) it is a new tensor this optimizer would never step. Build the optimizer after "
            "materialising the model"
        )
    if not p.requires_grad:
        raise ValueError(
            f"{name} does not require grad, so its step would never fire in backward; leave frozen tensors out "
            "(e.g. [p for p in model.parameters() if p.requires_grad]) or pass the nn.Module, which skips them"
        )


_SPARSE_CAPABLE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def check_sparse_modules(module: nn.Module, optimizer_class: type[torch.optim.Optimizer]) -> None:
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            if not issubclass(optimizer_class, _SPARSE_CAPABLE):
                raise ValueError(
                    f"{name or type(m).__name__} makes sparse gradients (sparse=True), which "
                    f"{optimizer_class.__name__} cannot step; use torch.optim.SparseAdam, SGD or Adagrad for it "
                    "(a param group may carry its own 'optimizer_class'), or build the embedding with sparse=False"
                )


def module_params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    fsdp1 = _fsdp1_module(module)
    if fsdp1 is not None:
        raise NotImplementedError(
            f"FullyShardedDataParallel (FSDP1) is not supported ({type(fsdp1).__name__}): its parameters' "
            "gradients never reach per-parameter hooks. Shard the model with torch.distributed.fsdp.fully_shard "
            "(FSDP2), which is supported, or keep FSDP1 with use_orig_params=True and attach "
            "dist_optim.apply_optimizer_in_backward to its parameters (after wrapping, or before "
            "init_process_group): FSDP1 steps those optimizers itself after its reduce-scatter"
        )
    named = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            named.append((name, p))
        else:
            logger.debug("skipping frozen parameter %s", name)
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameter that requires grad")
    return named


def _fsdp1_module(module: nn.Module) -> nn.Module | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return None
    return next((m for m in module.modules() if isinstance(m, FullyShardedDataParallel)), None)


@functools.cache
def dtensor_class() -> type | tuple[()]:
    """``DTensor``, imported at the first call, not at import: ``torch.distributed.tensor`` costs ~0.8 CPU s (it pulls
    in dynamo), which every process importing dist_optim would pay. ``()`` where torch is built without distributed
    (``isinstance(x, ())`` is always False)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return DTensor


def is_dtensor(p: torch.Tensor) -> bool:
    """A DTensor's gradient is produced by a distributed mechanism (FSDP2 reduce-scatters it before its hooks)."""
    return isinstance(p, dtensor_class())


def check_single_process(allow_local_steps: bool, params: list[torch.Tensor] | None = None,
                         next_to_dtensors: bool = False) -> None:
    """Refuse plain tensors in a multi-rank job: their hooks would see the local, un-reduced gradient.
    ``next_to_dtensors``: the optimizer has DTensor parameters too (tensor parallel, or FSDP2 on part of a model)."""
    dist = torch.distributed
    if allow_local_steps or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if params is not None and all(is_dtensor(p) for p in params):
        return
    if next_to_dtensors:
        raise RuntimeError(
            f"a process group with {dist.get_world_size()} ranks is initialised, and {len(params or [])} of these "
            "parameters are plain tensors next to DTensor ones (a model parallelized with tensor parallel, "
            "parallelize_module, or only partly sharded with fully_shard): nothing reduces their gradients, so "
            "each rank would step on its own local gradient. The standard loop does the same, which keeps the "
            "replicas equal only when every rank computes the same gradient for them (under tensor parallel, a "
            "norm fed replicated activations): then pass allow_local_steps=True. Otherwise parallelize them too "
            "(SequenceParallel for norms, fully_shard for the rest)"
        )
    raise RuntimeError(
        f"a process group with {dist.get_world_size()} ranks is initialised, but these parameters are neither "
        "sharded with fully_shard (FSDP2) nor given as a DistributedDataParallel model, so each rank would step "
        "on its own local, un-reduced gradient and the replicas would drift apart. Pass the DDP-wrapped model "
        "itself (not its .parameters()), shard with fully_shard, or pass allow_local_steps=True if local steps are "
        "what you want (local SGD)"
    )


def as_list(params: Any) -> list[Any]:
    """``params`` (the top level or a group's ``"params"``) as a list; a set is refused, as ``torch.optim`` does."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"optimizer parameters need to be organized in ordered collections (a list), got a "
            f"{type(params).__name__}, whose order changes between runs and would mismatch the state dict; pass a list"
        )
    return list(params)


def checked_entries(entries: list[Any], existing: list[torch.Tensor], group_index: int) -> list[torch.Tensor]:
    """A new group's ``params`` entries (tensors or ``(name, tensor)`` pairs) checked one by one, none given twice
    (nor already in ``existing``); returns the tensors."""
    known = {id(p) for p in existing}
    for k, entry in enumerate(entries):
        name, p = entry if isinstance(entry, tuple) else (f"param_groups[{group_index}][{k}]", entry)
        check_tensor(p, name)
        if id(p) in known:
            raise ValueError(f"{name} appears in more than one place; each parameter may be given only once")
        known.add(id(p))
    return [e[1] if isinstance(e, tuple) else e for e in entries]


def param_groups_of(params: Any) -> list[Any]:
    """``params`` as ``torch.optim`` takes it (tensors, ``(name, tensor)`` pairs or group dicts) as a list of
    groups, each group's ``"params"`` a list."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of Tensors, (name, Tensor) pairs or dicts, or an nn.Module, got a "
            "Tensor; wrap it in a list"
        )
    groups = as_list(params)
    if not groups:
        raise ValueError("InBackwardOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**g, "params": as_list(g["params"])} if isinstance(g, dict) and "params" in g else g for g in groups]


def norm_order_of(tensors: Any) -> dict[int, int]:
    """``grad_norm_order`` checked, as ``id(tensor) -> place`` (``None``: the given order)."""
    if tensors is None:
        return {}
    if isinstance(tensors, nn.Module):
        tensors = tensors.parameters()
    if isinstance(tensors, torch.Tensor) or isinstance(tensors, (set, frozenset)):
        raise TypeError(
            f"grad_norm_order must be an ordered iterable of tensors (e.g. model.parameters()) or an nn.Module, "
            f"got a {type(tensors).__name__}"
        )
    order: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grad_norm_order must hold tensors, got a {type(t).__name__}")
        order.setdefault(id(t), len(order))
    return order


def first_tensor(groups: list[Any]) -> torch.Tensor:
    """The first tensor given (its dtype and device build the probe of the class's defaults), else an empty one."""
    first = next((p for g in groups if isinstance(g, dict) for p in g.get("params", [])), None)
    if isinstance(first, tuple):
        first = first[1]
    return first if isinstance(first, torch.Tensor) else torch.empty(0)


def warn_fused_with_uneven_scale(scaler: Any, kernels: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """``scaler.step(opt)`` lets a fused kernel unscale the gradients itself (``grad / scale`` inside the kernel);
    in backward they are unscaled before the step (``grad * (1 / scale)``, as ``scaler.unscale_`` does). Both are
    exact while the scale is a power of two, as GradScaler's defaults keep it; other factors make them differ in
    the last bit, which is said once here rather than left silent."""
    if scaler is None or not scaler.is_enabled():
        return
    factors = internals.scaler_factors(scaler)
    uneven = {k: v for k, v in factors.items() if math.frexp(float(v))[0] != 0.5}
    fused = any(k.get("fused") or g.get("fused") for k, g in zip(kernels, groups))
    if uneven and fused:
        warnings.warn(
            f"grad_scaler has {', '.join(f'{k}={v}' for k, v in uneven.items())}, not a power of two, and the "
            "optimizer runs a fused kernel: scaler.step(opt) would let that kernel unscale the gradients itself, "
            "which rounds differently from unscaling them before the step as the in-backward step does, so results "
            "differ from scaler.step's in the last bit. Use powers of two (GradScaler's defaults), or foreach=True, "
            "whose scaler.step unscales first too",
            UserWarning,
            stacklevel=3,
        )


def split_group(param_group: Any, index: int, default_class: type) -> tuple[type, dict[str, Any], list[Any]]:
    """The class, the group without it, and the entries of ``param_group``, the ``index``-th group added."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    group = dict(param_group)
    cls = group.pop("optimizer_class", default_class)
    check_optimizer_class(cls)
    if "params" not in group:
        raise ValueError(f"param group {index} has no 'params' key")
    entries = as_list(group["params"])
    if not entries:
        raise ValueError(f"param group {index} has an empty 'params' list")
    return cls, group, entries


def names_of(filled: dict[str, Any], groups: list[dict[str, Any]]) -> list[str]:
    """The names of a group ``filled`` in by its class, to be added after ``groups``; all groups named or none."""
    if groups and ("param_names" in filled) != ("param_names" in groups[0]):
        raise ValueError(
            "all optimizer param groups should be with/without names. cannot add param group "
            f"{'with' if 'param_names' in filled else 'without'} names to the optimizer; give every group "
            "(name, tensor) pairs, e.g. from named_parameters(), or none"
        )
    return filled.get("param_names") or [f"param_groups[{len(groups)}][{k}]" for k in range(len(filled["params"]))]


def name_in(groups: list[dict[str, Any]], p: torch.Tensor) -> str:
    """``p``'s name in ``groups`` (its ``param_names`` entry, else ``param_groups[g][k]``)."""
    for gi, group in enumerate(groups):
        for k, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                return names[k] if names else f"param_groups[{gi}][{k}]"
    return "<unknown>"

"""torchtune: its ``OptimizerInBackwardWrapper`` checkpoints (one ``optimizer.state_dict()`` per parameter name)
converted to and from ``InBackwardOptimizer`` state dicts, both ways and exactly, and a builder for configs
(``_component_``). A recipe's ``scale_grads(model, 1 / num_tokens)`` before clipping becomes
``opt.set_grad_multiplier(1 / num_tokens)`` before the window's last backward (see docs/frameworks.md).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["build_optimizer", "from_torchtune_state_dict", "to_torchtune_state_dict"]


def to_torchtune_state_dict(optimizer: InBackwardOptimizer) -> dict[str, dict[str, Any]]:
    """``optimizer``'s state in the format of torchtune's ``OptimizerInBackwardWrapper.state_dict()``:
    ``{parameter name: {"state": {0: ...}, "param_groups": [{..., "params": [0]}]}}``.

    Raises:
        ValueError: the optimizer has no parameter names (build it from ``model.named_parameters()`` or the module).
    """
    state_dict = optimizer.state_dict()
    out: dict[str, dict[str, Any]] = {}
    for group in state_dict["param_groups"]:
        names = _names(group)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for index, name in zip(group["params"], names):
            state = state_dict["state"].get(index)
            out[name] = {"state": {} if state is None else {0: state}, "param_groups": [{**hyper, "params": [0]}]}
    return out


def from_torchtune_state_dict(state_dict: dict[str, dict[str, Any]], optimizer: InBackwardOptimizer) -> dict[str, Any]:
    """A state dict for ``optimizer.load_state_dict`` from a torchtune ``OptimizerInBackwardWrapper.state_dict()``.
    Each of the optimizer's param groups takes the hyperparameters its parameters had in torchtune.

    Raises:
        ValueError: ``state_dict`` is in torch's format, not torchtune's; the names differ (the missing and the
            unexpected ones, together), an entry is not an optimizer state dict, the optimizer has no
            parameter names, or the parameters of one group had different hyperparameters in torchtune.
    """
    if {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "this is a torch optimizer state dict ('state', 'param_groups'), the format InBackwardOptimizer itself "
            "saves: load it with optimizer.load_state_dict(state_dict); this function reads torchtune's "
            "{parameter name: optimizer state dict} format"
        )
    ours = optimizer.state_dict()["param_groups"]
    expected = [n for group in ours for n in _names(group)]
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the torchtune optimizer state does not match this optimizer's parameters: missing {missing}, "
            f"unexpected {unexpected}"
        )
    state: dict[int, Any] = {}
    groups = []
    for group in ours:
        names = _names(group)
        hypers = [_hyper(state_dict[n]) for n in names]
        for name, hyper in zip(names, hypers):
            differing = sorted(k for k in set(hyper) | set(hypers[0]) if not _same(hyper.get(k), hypers[0].get(k)))
            if differing:
                raise ValueError(
                    f"parameters {names[0]!r} and {name!r} share a param group here but had different {differing} "
                    "in torchtune; build the InBackwardOptimizer with param groups that match"
                )
        groups.append({**hypers[0], "params": list(group["params"]), "param_names": names})
        for index, name in zip(group["params"], names):
            entries = list(state_dict[name]["state"].values())
            if entries:
                state[index] = entries[0]
    return {"state": state, "param_groups": groups}


def build_optimizer(
    params: Any, optimizer_class: str | type[torch.optim.Optimizer], **kwargs: Any
) -> InBackwardOptimizer:
    """``InBackwardOptimizer(params, optimizer_class, **kwargs)`` with the class given as a dotted path, for
    configs that can only hold strings (torchtune's ``config.instantiate(cfg.optimizer, params)``)::

        optimizer:
          _component_: dist_optim.integrations.torchtune.build_optimizer
          optimizer_class: torch.optim.AdamW
          lr: 2e-5
          fused: True
          max_grad_norm: 1.0

    Raises:
        ValueError: ``optimizer_class`` is a string that names no importable attribute.
    """
    if isinstance(optimizer_class, str):
        module, _, name = optimizer_class.rpartition(".")
        try:
            optimizer_class = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            raise ValueError(
                f"optimizer_class={optimizer_class!r} names no importable class; give a dotted path such as "
                "'torch.optim.AdamW'"
            ) from None
    return InBackwardOptimizer(params, optimizer_class, **kwargs)


def _names(group: dict[str, Any]) -> list[str]:
    names = group.get("param_names")
    if not names:
        raise ValueError(
            "torchtune keys optimizer state by parameter name, and this optimizer has none: build it from "
            "model.named_parameters() or from the module itself"
        )
    return list(names)


def _hyper(entry: dict[str, Any]) -> dict[str, Any]:
    groups = entry.get("param_groups") if isinstance(entry, dict) else None
    if not groups:
        raise ValueError(
            "not a torchtune OptimizerInBackwardWrapper state dict: each parameter's entry must be an optimizer "
            f"state dict with 'state' and 'param_groups', got {type(entry).__name__} with keys "
            f"{sorted(entry) if isinstance(entry, dict) else []}"
        )
    return {k: v for k, v in groups[0].items() if k not in ("params", "param_names")}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b

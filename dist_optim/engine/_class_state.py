"""A wrapped class's own ``state_dict``/``load_state_dict`` and state conversion, run on the facade's groups and state.

A class that overrides ``torch.optim``'s state dict (bitsandbytes nests its quantised state; pytorch-optimizer
restores dtypes) gets its own format, through a *shell*: an instance of the class built as the standard loop builds
it, holding the facade's live groups and state. The facade's own state dict hooks run around it, as torch runs them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dist_optim import _torch_internals as internals
from dist_optim.engine._classes import (
    MODE_SWITCHES,
    hyperparameters,
    no_rng,
    switch_mode,
)
from dist_optim.engine._stepper import Recipe

__all__: list[str] = []


def own_class(recipe: Recipe, method: str) -> type[torch.optim.Optimizer] | None:
    """The optimizer class, if there is one class and it overrides ``torch.optim``'s ``method``."""
    classes = set(recipe.classes)
    if len(classes) != 1:
        return None
    cls = classes.pop()
    return cls if getattr(cls, method) is not getattr(torch.optim.Optimizer, method) else None


def _shell(opt: torch.optim.Optimizer, recipe: Recipe, cls: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    with no_rng([p for g in opt.param_groups for p in g["params"]]):
        shell = cls([{**hyperparameters(g), "params": g["params"]} for g in opt.param_groups], **recipe.kwargs_for(cls))
    shell.state, shell.param_groups = opt.state, opt.param_groups
    return shell


def class_state_dict(opt: torch.optim.Optimizer, recipe: Recipe, cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """``cls.state_dict`` of ``opt``'s groups and state, with ``opt``'s state dict hooks."""
    for pre_hook in internals.state_dict_pre_hooks(opt).values():
        pre_hook(opt)
    state_dict = cls.state_dict(_shell(opt, recipe, cls))
    for post_hook in internals.state_dict_post_hooks(opt).values():
        result = post_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    return state_dict


def class_load_state_dict(opt: torch.optim.Optimizer, recipe: Recipe, cls: type[torch.optim.Optimizer],
                          loaded: dict[str, Any]) -> None:
    """``cls.load_state_dict`` into ``opt``'s groups and state, with ``opt``'s load hooks."""
    for pre_hook in internals.load_state_dict_pre_hooks(opt).values():
        result = pre_hook(opt, loaded)
        loaded = loaded if result is None else result
    shell = _shell(opt, recipe, cls)
    cls.load_state_dict(shell, loaded)
    opt.state, opt.param_groups = shell.state, shell.param_groups
    for post_hook in internals.load_state_dict_post_hooks(opt).values():
        post_hook(opt)


def convert_loaded_state(opt: torch.optim.Optimizer, recipe: Recipe) -> None:
    """Let each group's optimizer class bring loaded state and groups to its current format, as its own
    ``__setstate__`` does in ``load_state_dict`` (older checkpoints hold ``step`` as a plain number, which the
    kernels refuse); the facade's is ``Optimizer.__setstate__``, which converts nothing."""
    for cls in dict.fromkeys(recipe.classes):
        groups = [g for c, g in zip(recipe.classes, opt.param_groups) if c is cls]
        state = {p: opt.state[p] for g in groups for p in g["params"] if p in opt.state}
        shell = cls.__new__(cls)  # the class's own conversion, run on our groups and state dicts in place
        cls.__setstate__(shell, {"defaults": dict(opt.defaults), "state": state, "param_groups": groups})


def forwarded_attribute(opt: torch.optim.Optimizer, recipe: Recipe, name: str) -> Any:
    """An attribute the wrapped class adds: ``train()``/``eval()`` of a class that has them (schedule-free), run on
    ``opt``'s groups and state; any other is refused by name (it would act on one bucket's optimizer, or on
    none), as ``AttributeError`` so that ``hasattr(opt, name)`` is ``False`` for it as for any missing one."""
    classes = [c for c in dict.fromkeys(recipe.classes or [recipe.optimizer_class]) if hasattr(c, name)]
    if name in MODE_SWITCHES and all(callable(getattr(c, name)) for c in classes) and classes:
        return functools.partial(_switch_mode, opt, recipe, name)
    if classes:
        raise AttributeError(
            f"{classes[0].__name__}.{name} is not available on InBackwardOptimizer: it is not forwarded, since "
            "it would act on the optimizer of one bucket (or of none) rather than on this optimizer's groups "
            f"and state. Use {classes[0].__name__} with a standard training loop if you need it"
        )
    raise AttributeError(f"'{type(opt).__name__}' object has no attribute '{name}'")


def _switch_mode(opt: torch.optim.Optimizer, recipe: Recipe, name: str) -> None:
    if internals.graph_task_id() != -1:
        raise RuntimeError(f"{name}() was called during a backward; call it between two steps")
    for cls in dict.fromkeys(recipe.classes):
        if callable(getattr(cls, name, None)):
            groups = [g for c, g in zip(recipe.classes, opt.param_groups) if c is cls]
            switch_mode(cls, name, groups, opt.state, opt.defaults)

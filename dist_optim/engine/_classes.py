"""What an optimizer class is, as the engine needs to know it: whether it steps with torch's own step, its step
without torch's profiling wrapper, its groups' options, its ``train()``/``eval()`` switches, and how to run it
without moving the user's random streams.

A leaf of the engine: the stepper that steps a class and the rule that probes what a class may do both use it.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dist_optim._torch_internals import unwrap_profiled_step

__all__: list[str] = []


def is_torch_step(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``cls`` steps with a ``torch.optim`` class's own step (torch's classes and subclasses that keep it):
    those are elementwise per tensor and write nothing into their groups, and the project picks their kernel."""
    step = getattr(cls.step, "__wrapped__", cls.step)
    return getattr(step, "__module__", "").startswith("torch.optim.")


@contextlib.contextmanager
def no_rng(like: list[torch.Tensor]) -> Iterator[None]:
    """Leave the global random streams as they were (torch's, Python's ``random``, numpy's where imported: classes
    draw from each, e.g. Kron's preconditioner updates): a probe must not shift a user's random draws."""
    devices = sorted({t.device.index or 0 for t in like if t.device.type == "cuda"})
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


MODE_SWITCHES = ("train", "eval")  # methods forwarded to the class over the facade's groups (schedule-free)


def switch_mode(cls: type[torch.optim.Optimizer], name: str, groups: list[dict[str, Any]], state: Any,
                defaults: dict[str, Any]) -> None:
    """Run ``cls``'s own ``train()``/``eval()`` on ``groups`` and ``state`` (the facade's: one copy of each), as
    the class's standard loop would on its own groups: it may move the parameters and write its groups' keys."""
    shell = cls.__new__(cls)
    shell.__dict__.update(defaults=defaults, state=state, param_groups=groups)
    getattr(cls, name)(shell)


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's options, without its tensors and their names."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def unwrapped_step(optimizer_class: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``optimizer_class.step`` without torch's profiling wrapper, whose global step hooks must fire once per
    training step with the facade as argument, never once per bucket with an inner optimizer."""
    return unwrap_profiled_step(optimizer_class.step)


def check_takes_params(cls: type[torch.optim.Optimizer]) -> None:
    """Refuse a class whose constructor takes the model rather than parameters (pytorch-optimizer's ``AdamMini``
    groups the model's parameters by their names itself): its groups cannot be split into buckets."""
    try:
        first = next(iter(list(inspect.signature(cls.__init__).parameters.values())[1:]), None)
    except (TypeError, ValueError):
        return  # no readable signature: the class is built as torch.optim's are, and says itself what it lacks
    if first is not None and (first.name == "model" or "Module" in str(first.annotation)):
        name = f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"
        raise NotImplementedError(
            f"{name} takes the model ({first.name!r}) rather than parameters, and groups them by name itself, so its "
            "groups cannot be split into buckets stepped inside backward; use it in a standard training loop"
        )

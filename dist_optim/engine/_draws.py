"""A class's step watched for random draws the construction probe did not see.

The probe (``_rule``) steps a class on small tensors for a few steps; a class may draw from torch's global
generator only on larger tensors or every k steps (pytorch-optimizer's ``Alice`` draws a ``randperm`` when a
tensor has more rows than its ``leading_basis``). Stepped bucket by bucket, each tensor then gets other numbers
than in the standard loop's one ``step()``: parameters differ in the last bits, without an error. Every bucket
step of a class torch does not ship is therefore watched, when buckets would reorder its draws, by comparing the
generators' states around it (a few microseconds); a draw is refused there, loudly, in the middle of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dist_optim._torch_internals import is_fake

__all__: list[str] = []


class DrawWatch:
    """Runs the step of ``cls``'s inner optimizer over one bucket, refusing when it moves a global random generator."""

    def __init__(self, cls: type, why: str | None) -> None:
        self.cls = cls
        self.why = why  # why reordered draws are refused here (DDP's reason), or None: random_draws="exact"

    def run(self, step: Callable[[torch.optim.Optimizer], Any], opt: torch.optim.Optimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(is_fake(p) for p in params[:1]):
            step(opt)  # the memory planner's fake tensors: no numbers drawn, nothing to compare
            return
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        before = _states(devices)
        step(opt)
        if any(not torch.equal(a, b) for a, b in zip(before, _states(devices))):
            raise RuntimeError(self.message())

    def message(self) -> str:
        name = f"{self.cls.__module__.split('.')[0]}.{self.cls.__qualname__}"
        fix = ("use bucket_cap_mb=float('inf') (one step() over all tensors, the standard loop's) or a standard "
               "training loop" if self.why is not None else
               "use bucket_cap_mb=float('inf') (one step() over all tensors: the standard loop's draws), or "
               "random_draws='reordered' to accept other draws per tensor (docs/optimizers.md)")
        reason = f" ({self.why})" if self.why is not None else ""
        return (
            f"{name} drew random numbers from torch's global generator while stepping one bucket, which its probe at "
            "construction did not show (it draws on other shapes or steps): stepped bucket by bucket, each tensor "
            f"gets other numbers than in the standard loop{reason}. Refused now, in the step that drew: that step "
            f"is incomplete (opt.step_incomplete; reload the last checkpoint to go on exactly). To train with it, {fix}"
        )


def _states(devices: list[int]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]

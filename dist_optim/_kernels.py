"""How an inner optimizer is called: which implementation (fused, foreach) and through which ``step``.

torch's own default keeps CPU on the slow for-loop; the engine picks the fastest kernel that runs on the tensors,
and calls ``step`` without torch's profiling wrapper so that global step hooks fire once per training step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dist_optim._inputs import is_dtensor

__all__: list[str] = []


def unwrapped_step(optimizer_class: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``optimizer_class.step`` without torch's profiling wrapper, whose global step hooks must fire once per
    training step with the facade as argument, never once per bucket with an inner optimizer."""
    step = optimizer_class.step
    if getattr(step, "hooked", False):
        return step.__wrapped__  # type: ignore[attr-defined]
    return step


def implementation(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pick ``fused`` (else ``foreach``) for a group whose user left both unset, if it runs on these tensors."""
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return {}
    for flag in ("fused", "foreach"):
        if flag == "fused" and issubclass(cls, torch.optim.SGD):
            # torch's fused SGD fails on a group where some momentum buffers exist and some do not yet (a parameter
            # unused so far, or a layer added to a resumed model), which foreach and the for-loop handle.
            continue
        if flag in group and runs(cls, group, kwargs, flag):
            return {flag: True}
    return {}


def runs(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any], flag: str) -> bool:
    """Whether ``cls`` steps with ``flag=True`` on tiny tensors like this group's (some refuse only at step)."""
    probes = []
    seen = set()
    for p in group["params"]:
        key = (p.dtype, p.device, p.ndim, type(p), getattr(p, "device_mesh", None))
        if key not in seen:
            seen.add(key)
            probes.append(_probe_like(p))
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    try:
        opt = cls([{**hyper, "params": probes, flag: True}], **kwargs)
        unwrapped_step(cls)(opt)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def _probe_like(p: torch.Tensor) -> torch.Tensor:
    """A one-element tensor of ``p``'s kind with a zero gradient; for a DTensor, a replicated DTensor on its mesh
    (built locally, no communication), since DTensor lacks some fused kernels that plain tensors have."""
    local = torch.zeros([1] * p.ndim, dtype=p.dtype, device=p.device)
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor, Replicate

        mesh = p.device_mesh
        probe = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
        grad = DTensor.from_local(torch.zeros_like(local), mesh, [Replicate()] * mesh.ndim, run_check=False)
    else:
        probe, grad = local, torch.zeros_like(local)
    probe.requires_grad_(True)
    probe.grad = grad
    return probe

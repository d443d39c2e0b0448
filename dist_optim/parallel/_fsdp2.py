"""What the engine needs to know of FSDP2 (``fully_shard``) beyond its public API: whether a unit holds unsharded
gradients accumulated without gradient sync (``set_requires_gradient_sync(False)``), which no sharded parameter
shows and which FSDP2 reduces, and forgets, in the next backward that syncs.

FSDP2 has no public query for it; this reads ``FSDPParam``'s fields, and says so by name when a torch upgrade moves
them, rather than guessing.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from dist_optim._torch_internals import UNSHARDED_PARAM, fsdp_param_groups

__all__: list[str] = []


def fsdp_units(module: nn.Module) -> list[weakref.ref]:
    """Weak references to the ``fully_shard``-ed modules in ``module`` (none without torch.distributed)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [weakref.ref(m) for m in module.modules() if isinstance(m, FSDPModule)]


# FSDPParamGroup's training states of a unit whose backward has begun (IDLE again once the backward ends)
_IN_THIS_BACKWARD = ("PRE_BACKWARD", "POST_BACKWARD")


def accumulated_unsharded(units: list[weakref.ref]) -> bool:
    """Whether a unit holds unsharded gradients that a backward without gradient sync accumulated: a unit idle
    (not in the running backward, if one runs) holding them."""
    for ref in units:
        unit: Any = ref()
        if unit is None:
            continue
        try:
            groups = fsdp_param_groups(unit)
            for group in groups:
                if group._training_state.name in _IN_THIS_BACKWARD:
                    continue  # its gradients are this backward's (the root's, computed first, reduced last)
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, UNSHARDED_PARAM, None)  # created at the first all-gather
                    if fp.unsharded_accumulated_grad is not None or (unsharded is not None and
                                                                     unsharded.grad is not None):
                        return True
        except AttributeError as e:
            raise NotImplementedError(
                f"this torch's FSDP2 does not show whether unsharded gradients were accumulated ({e}), which "
                "clip_mode='two_pass' needs to know; use clip_mode='exact'"
            ) from None
    return False

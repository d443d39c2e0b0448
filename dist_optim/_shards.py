"""Stepping DTensor parameters (FSDP2 shards) through their local tensors.

An elementwise optimizer does on a DTensor exactly what it does on the local shard: DTensor dispatches each
foreach/fused call to the same kernel on the local tensors. The dispatch itself costs about 0.5 ms per call on CPU
(a fused AdamW call over 16 shards: 1.18 ms as DTensors, 0.66 ms on their local tensors), paid once per bucket,
where the standard loop pays it once per step. So buckets of DTensors are stepped on stand-ins for their local
shards, with the optimizer state seen through its local tensors; the facade's ``state`` keeps DTensors (new state
is wrapped, without a copy, with the parameter's mesh, placements, shape and stride), so state dicts and
checkpoints are those of the standard loop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from dist_optim._inputs import is_dtensor

__all__: list[str] = []

# Optimizers whose step is elementwise given the hyperparameters (no norm or reduction over a tensor).
ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
})


def can_step_locally(cls: type, params: list[torch.Tensor]) -> bool:
    return cls in ELEMENTWISE and all(is_dtensor(p) and hasattr(p, "_local_tensor") for p in params)


class LocalShards:
    """Stand-ins for the local shards of some DTensor parameters, and the local view of their state."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.stand_ins = {id(p): p._local_tensor.detach() for p in params}
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)  # the inner optimizer's
        self._seen: dict[int, dict[str, Any]] = {}  # id(param) -> the facade state dict its local view came from

    def stand_in(self, p: torch.Tensor) -> torch.Tensor:
        return self.stand_ins[id(p)]

    def stepper(self, step: Callable[[torch.optim.Optimizer], Any], facade_state: dict) -> Callable[..., Any]:
        def run(inner: torch.optim.Optimizer) -> None:
            new = []
            for p in self.params:
                a = self.stand_ins[id(p)]
                local = p._local_tensor
                if a.data_ptr() != local.data_ptr() or a.shape != local.shape:
                    a.data = local  # FSDP2 re-created the shard (module.to(), lazy init): follow it
                g = p.grad
                if g is None:
                    a.grad = None
                    continue
                a.grad = g._local_tensor
                mine = facade_state.get(p)
                if not mine:
                    self.state.pop(a, None)
                    new.append(p)
                elif mine is not self._seen.get(id(p)):  # new, or replaced (load_state_dict, a standard step)
                    self.state[a] = {k: v._local_tensor if is_dtensor(v) else v for k, v in mine.items()}
                    self._seen[id(p)] = mine
            try:
                step(inner)
            finally:
                for p in new:
                    local_state = self.state.get(self.stand_ins[id(p)])
                    if local_state:
                        facade_state[p] = wrapped = {k: _like(p, v) for k, v in local_state.items()}
                        self._seen[id(p)] = wrapped
                for a in self.stand_ins.values():
                    a.grad = None  # the gradient's memory goes with the parameter's .grad

        return run


def _like(p: torch.Tensor, v: Any) -> Any:
    """``v``, a state tensor made for ``p``'s local shard, as the DTensor the standard loop would hold."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape != p._local_tensor.shape:
        return v  # a scalar (``step``): a plain tensor in the standard loop too
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

"""Optimizers whose step cannot run on fake tensors (torchao's compiled low-bit steps, which kill the process there;
bitsandbytes' C kernels, which read the tensors' addresses), planned from their own state instead.

The class's own step is run on small real parameters (once per distinct size class, eagerly: the state it makes is
the compiled step's) and the bytes of the state it keeps are read back: per parameter, ``a * numel + c`` on two
sizes congruent to the parameter's modulo 4096 (every block size of those libraries divides 4096, so the blocks
and their scales grow linearly between them, and the branch each library takes on small or unaligned parameters
is the parameter's own). The trace then runs :func:`stand_in`, an optimizer that keeps that many bytes of state per
parameter and, as it steps each parameter, holds the real step's temporaries for that parameter (its dequantized
moments and update): STEP_BYTES per element, measured by ``benchmarks/bench_plan_models.py`` (exactly linear in the
parameter's size on CPU; a class not measured there is planned with the most of those, said in ``not_seen``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from dist_optim._planner._fsdp2 import local

__all__: list[str] = []

logger = logging.getLogger(__name__)

NO_FAKE_STEP = ("torchao.", "bitsandbytes.")  # the modules whose optimizers' steps cannot run on fake tensors
_ALIGN = 4096  # a multiple of every block size (torchao 128 / 256, bitsandbytes 256) and their small-size cut
_PROBE = (1 << 16, 1 << 17)  # the two probed sizes, before adding the parameter's residue modulo _ALIGN
# bytes per element of the parameter being stepped that the warm step holds at its peak besides the state, by class
# and parameter dtype (the compiled step on CPU, torchao 0.11, bitsandbytes 0.50: benchmarks/bench_plan_models.py)
STEP_BYTES = {
    "torchao.optim.adam.AdamW8bit": {torch.float32: 8.03125, torch.bfloat16: 8.03125},
    "torchao.optim.adam.AdamW4bit": {torch.float32: 26.0625, torch.bfloat16: 26.0625},
    "bitsandbytes.optim.adamw.AdamW8bit": {torch.float32: 20.0, torch.bfloat16: 24.0},
}
UNMEASURED_STEP_BYTES = max(b for by_dtype in STEP_BYTES.values() for b in by_dtype.values())


def steps_on_fake(cls: type) -> bool:
    """Whether ``cls``'s step can run on fake tensors (not the low-bit libraries')."""
    return not any(cls.__module__.startswith(m) for m in NO_FAKE_STEP)


def storages(value: Any) -> Iterator[torch.UntypedStorage]:
    """The storages under a state value: a tensor, or a tensor subclass's inner tensors (torchao's OptimState)."""
    if not isinstance(value, torch.Tensor):
        return
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is not None and type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from storages(getattr(value, name))
        return
    yield value.untyped_storage()


def _state_bytes(cls: type, kwargs: dict[str, Any], numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """The bytes of the state ``cls`` keeps for each real parameter of ``numel`` elements after one step, and those
    it keeps once for all its parameters (bitsandbytes' quantization maps: the same tensors in every parameter's
    state), read from two parameters stepped by one optimizer."""
    ps = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype)) for _ in range(2)]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt = cls(ps, **kwargs)
    with torch.compiler.set_stance("force_eager"):  # the same state as compiled, without compiling every size
        opt.step()
    held = [{st.data_ptr(): st.nbytes() for value in opt.state[p].values() for st in storages(value)} for p in ps]
    shared = sum(n for ptr, n in held[0].items() if ptr in held[1])
    return sum(held[0].values()) - shared, shared


def _real(cls: type, kwargs: tuple[tuple[str, Any], ...], numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """:func:`_state_bytes` on a thread of its own: none of the planner's modes (fake tensors, traces) there."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_state_bytes, cls, dict(kwargs), numel, dtype).result()


@functools.lru_cache(maxsize=None)
def state_bytes(cls: type, kwargs: tuple[tuple[str, Any], ...], numel: int, dtype: torch.dtype) -> int:
    """The state bytes of a parameter of ``numel`` elements (those kept once for all parameters apart: see
    :func:`shared_state_bytes`): measured where it is small, else extrapolated from two probes of the same residue
    modulo _ALIGN (exact: linear in the number of blocks)."""
    logger.info("stepping %s on real parameters to read its state for %d elements", cls.__name__, numel)
    if numel <= _PROBE[1]:
        return _real(cls, kwargs, numel, dtype)[0]
    n1, n2 = (n + numel % _ALIGN for n in _PROBE)
    b1, b2 = _real(cls, kwargs, n1, dtype)[0], _real(cls, kwargs, n2, dtype)[0]
    return b1 + (b2 - b1) * (numel - n1) // (n2 - n1)


@functools.lru_cache(maxsize=None)
def shared_state_bytes(cls: type, kwargs: tuple[tuple[str, Any], ...], dtype: torch.dtype) -> int:
    """The state bytes an optimizer of ``cls`` keeps once for all its parameters."""
    return _real(cls, kwargs, _PROBE[0], dtype)[1]


def stand_in(cls: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any]) -> type[torch.optim.Optimizer]:
    """An optimizer class for the trace: ``cls``'s state bytes (:func:`state_bytes`) per parameter, as one uint8
    tensor made at the first step (and those it keeps once for all parameters, one tensor in every state), and at
    each step, parameter after parameter, the step's temporaries (:func:`step_bytes`); no update."""
    kwargs = tuple(sorted(optimizer_kwargs.items()))

    class StandIn(torch.optim.Optimizer):
        stands_in = True  # for Job: the engine probes it on real tensors

        def __init__(self, params: Any, **kw: Any) -> None:
            super().__init__(params, kw)
            self._shared: torch.Tensor | None = None  # bitsandbytes' quantization maps: one for all parameters

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    mine = local(p)  # a sharded parameter's local shard: what the class steps on this rank
                    if not self.state[p]:
                        n = state_bytes(cls, kwargs, mine.numel(), mine.dtype)
                        self.state[p]["state"] = torch.zeros(n, dtype=torch.uint8, device=mine.device)
                        if self._shared is None:  # made once an optimizer, then the same tensor in every state
                            self._shared = torch.zeros(shared_state_bytes(cls, kwargs, mine.dtype),
                                                       dtype=torch.uint8, device=mine.device)
                        if self._shared.numel():
                            self.state[p]["shared"] = self._shared
                    temporaries = torch.empty(step_bytes(cls, mine), dtype=torch.uint8, device=mine.device)
                    del temporaries

    StandIn.__name__ = StandIn.__qualname__ = f"{cls.__name__}StandIn"
    return StandIn


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def step_bytes(cls: type, p: torch.Tensor) -> int:
    """The temporaries ``cls``'s step holds while it updates ``p`` (STEP_BYTES per element)."""
    per_element = STEP_BYTES.get(_name(cls), {}).get(p.dtype, UNMEASURED_STEP_BYTES)
    return int(per_element * p.numel())


def not_seen(cls: type) -> tuple[str, ...]:
    """What the plan of ``cls``, traced as :func:`stand_in`, takes from measurements instead of a trace."""
    measured = STEP_BYTES.get(_name(cls))
    how = (f"its step's temporaries, {max(measured.values()):g} bytes per element of the parameter being stepped "
           "at most (measured, benchmarks/bench_plan_models.py)" if measured else
           f"its step's temporaries, not measured for this class: planned at {UNMEASURED_STEP_BYTES:g} bytes per "
           "element of the parameter being stepped (the most of the low-bit classes measured)")
    return (f"{cls.__name__}'s step, which cannot run on fake tensors: not traced; its state is the class's own, "
            f"made by its step on real parameters of the same sizes, and {how}",)

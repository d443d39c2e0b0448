"""What an inner optimizer may do to be stepped one bucket at a time, checked once per param group at construction.

Stepping bucket by bucket equals the standard loop only when the class's step for a tensor depends on that tensor's
gradient and state alone, and on group-level state the stepper carries (``_stepper.step_inner_optimizers``). A
class torch does not ship is checked by behaviour: it is stepped on small probe tensors shaped like the group's,
once as the standard loop does and once one tensor at a time in backward's order, and both must agree bitwise.
A class that does not is refused with the reason, unless every step is one ``step()`` over all of its groups, or
the only difference is which tensor gets which of the random numbers the standard loop draws (stochastic rounding),
which ``random_draws="reordered"`` accepts.
"""

from __future__ import annotations

import functools
import random
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from dist_optim._torch_internals import LR_SCHEDULER_STEP_MARK
from dist_optim.engine._classes import (
    MODE_SWITCHES,
    hyperparameters,
    is_torch_step,
    no_rng,
    switch_mode,
    unwrapped_step,
)
from dist_optim.engine._inputs import is_dtensor
from dist_optim.engine._stepper import Recipe, step_inner_optimizers

__all__: list[str] = []

PROBE_STEPS = 3  # enough for a counter written at the first step and read at the next, and a warm-up branch
PROBE_TENSORS = 3  # per group: a step coupling tensors shows with two; three catch "first"/"last" special cases
PROBE_GRAD_SCALES = (1e-3, 1.0, 1e2)  # per probe tensor: a statistic over the group (AdamS's mean of the second
# moments, scaling its weight decay by 1e-7 at lr=1e-3) then differs from each tensor's own by orders of magnitude,
# and the difference shows in the bits where gradients of one scale would hide it
PROBE_DIM = 6  # each dimension of a probe is min(the parameter's, this): small, and above the ranks of factored
# classes' defaults (Adafactor-style row/column factors, Muon's 2-D test)


def check_bucketable(
    cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any], one_step: bool,
    random_draws: str = "exact", reordering_refused: str | None = None,
) -> None:
    """Refuse ``cls`` for ``group`` (a group the class filled) unless stepping it per bucket is its standard step.

    Args:
        one_step: every training step is one call over all of this class's groups (``bucket_cap_mb=inf`` on one
            process): then only what a single call cannot do is checked.
        random_draws: ``"reordered"`` accepts a class whose tensors' steps differ per bucket only by which tensor
            gets which of the random numbers the standard loop draws (``InBackwardOptions.random_draws``).
        reordering_refused: why this setting cannot accept that (under DDP: ranks could step in other orders).

    Raises:
        NotImplementedError: naming the class, what differs, and the fix.
    """
    if is_torch_step(cls):
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    prop = getattr(cls, "state", None)
    if isinstance(prop, property) and prop.fset is None:
        raise NotImplementedError(
            f"{name} keeps its state behind a read-only 'state' property, so InBackwardOptimizer cannot hand its "
            "bucket optimizers the one state they share; use it with a standard training loop"
        )
    tensors = [p for p in group["params"]]
    with no_rng(tensors), torch.enable_grad():
        try:
            found = _compare(cls, group, kwargs, tensors, split=not one_step)
        except Exception as e:  # a class that fails on the probe cannot be shown to be exact: refused with why
            first = str(e).splitlines()[0] if str(e) else ""
            raise NotImplementedError(
                f"{name} cannot be stepped by InBackwardOptimizer: stepping it as its standard loop would, on "
                f"small tensors like this group's, raised {type(e).__name__}: {first} (a class that needs a "
                "closure, second-order gradients or tensors of other shapes cannot be checked). Use it with a "
                "standard training loop"
            ) from e
    if found is None:
        return
    if found is REORDERED:
        _check_reordered(name, random_draws, reordering_refused, tensors)
        return
    reason = found
    if one_step or reason.startswith(_OWN_ATTRIBUTE):
        raise NotImplementedError(
            f"{name} cannot be stepped by InBackwardOptimizer: {reason}. InBackwardOptimizer carries param "
            "groups and per-tensor state only, so its state_dict() and a resume would miss that. Use it with a "
            "standard training loop"
        )
    raise NotImplementedError(
        f"{name} cannot be stepped one bucket at a time: {reason}. InBackwardOptimizer steps each bucket as "
        "soon as its gradients are ready, which equals the standard loop only when a tensor's step depends on "
        "its own gradient and state (and on group-level values the class writes the same whichever tensors it "
        "steps). Pass bucket_cap_mb=float('inf') on one process (one step over all tensors when backward "
        "ends: exact, without the memory saving), or use it with a standard training loop"
    )


_OWN_ATTRIBUTE = "it keeps state in its own attribute"
REORDERED = "its tensors' steps differ only by the random draws each gets"  # what _compare found, by identity


def check_group(recipe: Recipe, cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> None:
    """Refuse a group that ``recipe`` would step with ``cls`` but ``cls`` cannot step one bucket at a time."""
    one_step = recipe.one_step and not any(is_dtensor(p) for p in group["params"])
    check_bucketable(cls, group, recipe.kwargs_for(cls), one_step, recipe.random_draws, recipe.reordering_refused)


def _check_reordered(name: str, random_draws: str, reordering_refused: str | None,
                     tensors: list[torch.Tensor]) -> None:
    """Accept a class whose per-bucket step differs from its own loop only by which tensor gets which draws, where
    the user asked for that (``random_draws="reordered"``) and the setting steps every rank in one order."""
    if random_draws != "reordered":
        raise NotImplementedError(
            f"{name} cannot be stepped one bucket at a time exactly: each tensor's step draws random numbers from "
            "the global random streams (stochastic rounding, random projections), and stepping bucket by bucket, in "
            "the order gradients arrive, gives each tensor other draws than the standard loop, which steps the "
            "tensors in the group's order. Pass random_draws='reordered' to accept that: its probes show that this "
            "is the only difference (the same numbers drawn, for other tensors): the parameters differ from the "
            "standard loop's about as much as two runs from different seeds do (docs/optimizers.md). Or pass "
            "bucket_cap_mb=float('inf') on one process (one step over all tensors when backward ends: exact, "
            "without the memory saving), or use it with a standard training loop"
        )
    if any(is_dtensor(p) for p in tensors):
        raise NotImplementedError(
            f"{name} draws random numbers in each tensor's step, and random_draws='reordered' accepts that on one "
            "process and under DDP only: on DTensor parameters (FSDP2, tensor parallel) the draws go through "
            "DTensor's random ops on each rank's shards, an order across ranks this library does not test. Use it "
            "with a standard training loop"
        )
    if reordering_refused is not None:
        raise NotImplementedError(
            f"{name} draws random numbers in each tensor's step, and random_draws='reordered' needs every rank to "
            f"step the tensors in one order (so that the replicas get the same draws): {reordering_refused}"
        )


def _compare(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any],
             like: list[torch.Tensor], split: bool) -> str | None:
    """``None`` if the standard step and the per-tensor step agree bitwise on probes, :data:`REORDERED` if they
    differ only by which tensor gets which random draws, else what differs. ``split=False``: only what one step
    over all tensors cannot carry either (the class's own counters).

    Each run starts from the same positions of the global random streams. A per-tensor step in backward's order
    that differs, or that agrees while the class's steps draw from those streams (on probes a draw may round alike
    where on the model's tensors it does not: DASH's power iterations), is stepped one tensor per bucket twice
    more: in the standard loop's order, which must be the standard step bitwise (the class steps each tensor on
    its own, draws included) and leave the streams where it does; then in backward's order with the streams set,
    before each tensor, where that tensor's step found them in the standard loop's order, which must be the
    standard step bitwise too (a tensor's step depends on its own gradient and state and on the streams'
    position, nothing else). The plain per-bucket run must also leave the streams where the standard loop does
    (the same number of draws)."""
    options = hyperparameters(group)
    shapes = [_probe_shape(like[k % len(like)]) for k in range(PROBE_TENSORS)]
    kind = like[0]
    gen = torch.Generator(device=kind.device).manual_seed(0)
    start = [torch.randn(s, generator=gen, device=kind.device).to(kind.dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=gen, device=kind.device) * scale).to(kind.dtype)
              for s, scale in zip(shapes, PROBE_GRAD_SCALES)] for _ in range(PROBE_STEPS)]
    devices = _cuda_devices(like)
    modes = [m for m in MODE_SWITCHES if callable(getattr(cls, m, None))]

    def leaves() -> list[torch.Tensor]:
        return [_as_kind(t.clone(), kind).requires_grad_(True) for t in start]

    # the standard loop
    _seed_streams()
    ref_params = leaves()
    ref = cls([{**options, "params": ref_params}], **kwargs)
    if "train" in modes:
        cls.train(ref)  # type: ignore[attr-defined]
    counters: dict[str, Any] = {}
    ref_start = _positions(devices)
    for k, step_grads in enumerate(grads):
        for p, g in zip(ref_params, step_grads):
            p.grad = _as_kind(g.clone(), kind)
        unwrapped_step(cls)(ref)  # not ref.step(): global step hooks must not see the probe
        if k == 0:
            counters = _attributes(ref)
    ref_end = _positions(devices)
    draws = _differs(ref_start, ref_end) is not None  # its steps draw from the global streams
    moved = [k for k, v in _attributes(ref).items() if k not in counters or _differs(counters[k], v)]
    if moved:
        return (f"{_OWN_ATTRIBUTE} {moved[0]!r}, which changes at every step, outside its param groups and "
                "per-tensor state (each bucket's optimizer would keep its own copy)")
    if not split:
        return None
    if "eval" in modes:  # what a user evaluates (schedule-free: the averaged point) must agree as well
        cls.eval(ref)  # type: ignore[attr-defined]

    def per_tensor(order: list[int], at: list[list[Any]] | None = None,
                   record: list[list[Any]] | None = None) -> tuple[str | None, list[Any]]:
        """Step the probes one tensor per bucket, tensors in ``order``, through the stepper; with ``at``, the
        streams set to ``at[step][tensor]`` before each tensor's step; ``record`` collects those positions.
        Returns what differs from the standard loop (``None``: nothing) and where the streams ended."""
        run = _PerTensor(cls, options, kwargs, leaves(), ref.defaults, modes, order)
        for s, step_grads in enumerate(grads):
            if record is not None:
                record.append([None] * PROBE_TENSORS)

            def before(k: int, s: int = s) -> None:
                if at is not None:
                    _restore(at[s][k], devices)
                if record is not None:
                    record[s][k] = _positions(devices)

            run.step(step_grads, kind, before)
        end = _positions(devices)
        run.finish()
        return run.differs(ref, ref_params), end

    backward = list(reversed(range(PROBE_TENSORS)))
    _seed_streams()
    reason, end = per_tensor(backward)
    if reason is None and not draws:
        return None
    if reason is None:  # the same bits on the probes, but on other tensors other draws may not round alike
        reason = ("its steps draw random numbers from the global random streams, which stepping one bucket at a "
                  "time in backward's order gives to other tensors")
    _seed_streams()
    at: list[list[Any]] = []
    in_order, forward_end = per_tensor(list(range(PROBE_TENSORS)), record=at)
    if in_order is not None or _differs(ref_end, forward_end) is not None:
        return reason  # stepped one at a time in the standard loop's own order it differs too: coupled
    replayed, _ = per_tensor(backward, at=at)
    if replayed is None and _differs(ref_end, end) is None:
        return REORDERED
    return reason


class _PerTensor:
    """Probe tensors stepped one tensor per bucket through the stepper, as the engine steps buckets."""

    def __init__(self, cls: type[torch.optim.Optimizer], options: dict[str, Any], kwargs: dict[str, Any],
                 params: list[torch.Tensor], defaults: dict[str, Any], modes: list[str], order: list[int]) -> None:
        self.cls, self.params, self.defaults, self.modes, self.order = cls, params, defaults, modes, order
        built = cls([{**options, "params": params}], **kwargs)  # as add_param_group fills a group
        self.group = built.param_groups[0]
        self.owner = types.SimpleNamespace(param_groups=[self.group], state=defaultdict(dict))
        self.owner.state.update(built.state)  # state some classes create at construction
        recipe = Recipe(self.owner, cls, kwargs)  # type: ignore[arg-type]
        recipe.classes, recipe.kernels, recipe.watch_draws = [cls], [{}], False
        self.buckets = [recipe.build([(0, False, [params[k]])]) for k in order]
        if "train" in modes:
            switch_mode(cls, "train", self.owner.param_groups, self.owner.state, defaults)

    def step(self, step_grads: list[torch.Tensor], kind: torch.Tensor, before: Callable[[int], None]) -> None:
        for p, g in zip(self.params, step_grads):
            p.grad = _as_kind(g.clone(), kind)
        started: dict[int, dict[str, Any]] = {}
        for k, inners in zip(self.order, self.buckets):
            before(k)
            step_inner_optimizers(inners, started)

    def finish(self) -> None:
        if "eval" in self.modes:
            switch_mode(self.cls, "eval", self.owner.param_groups, self.owner.state, self.defaults)

    def differs(self, ref: torch.optim.Optimizer, ref_params: list[torch.Tensor]) -> str | None:
        """What differs from the standard loop's ``ref`` (``None``: nothing)."""
        for a, b in zip(ref_params, self.params):
            if not torch.equal(a, b):
                return f"its parameters differ after {PROBE_STEPS} steps when the tensors are stepped one at a " \
                       "time (the step couples tensors: a norm, mean or count over the group, or random draws " \
                       "whose number depends on the calls)"
            diff = _differs(ref.state.get(a, {}), self.owner.state.get(b, {}))
            if diff:
                return f"its per-tensor state {diff!r} differs when the tensors are stepped one at a time"
        extra_ref = {k: v for k, v in ref.state.items() if not isinstance(k, torch.Tensor)}
        extra = {k: v for k, v in self.owner.state.items() if not isinstance(k, torch.Tensor)}
        diff = _differs(extra_ref, extra)
        if diff:
            return f"it keeps state {diff!r} outside its tensors' entries, which advances once per bucket"
        diff = _differs(hyperparameters(ref.param_groups[0]), hyperparameters(self.group))
        if diff:
            return f"its param group's {diff!r} depends on which tensors a step() call sees"
        return None


def _cuda_devices(like: list[torch.Tensor]) -> list[int]:
    return sorted({t.device.index or 0 for t in like if t.device.type == "cuda"})


def _seed_streams() -> None:
    """The same start for every probe run, in every global stream a class may draw from."""
    torch.manual_seed(0)
    random.seed(0)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(0)


def _positions(devices: list[int]) -> list[Any]:
    """Where the global random streams are: torch's CPU and CUDA generators, Python's ``random``, numpy's."""
    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    return [torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], random.getstate(),
            None if state is None else (state[0], state[1].tolist(), *state[2:])]


def _restore(positions: list[Any], devices: list[int]) -> None:
    cpu, cuda, python, state = positions
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)
    random.setstate(python)
    if state is not None:
        numpy = sys.modules["numpy"]
        numpy.random.set_state((state[0], numpy.array(state[1], dtype=numpy.uint32), *state[2:]))


@functools.cache
def _torch_attributes() -> frozenset[str]:
    """The attributes torch's Optimizer gives every instance. Built at the first use, not at import: constructing
    an optimizer imports torch._dynamo (~0.85 CPU s), which a process that never steps in backward would pay."""
    return frozenset(torch.optim.SGD([torch.zeros(1, requires_grad=True)]).__dict__) | {LR_SCHEDULER_STEP_MARK}


def _attributes(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own attributes that hold numbers or tensors (where a counter would live), copied."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(opt).items()
            if k not in _torch_attributes() and isinstance(v, (bool, int, float, str, torch.Tensor))}


def _as_kind(t: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of ``kind``'s type: for a DTensor parameter, a replicated DTensor on its mesh (built
    locally, no communication), so that a class that cannot step DTensors (bitsandbytes' kernels) fails here."""
    if not is_dtensor(kind):
        return t
    from torch.distributed.tensor import DTensor, Replicate

    mesh = kind.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _probe_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(min(int(d), PROBE_DIM) for d in p.shape)


def _differs(a: Any, b: Any, key: str = "") -> str | None:
    """The first key where two states differ (bitwise for tensors), else ``None``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in dict.fromkeys([*a, *b]):
            if k not in a or k not in b:
                return str(k)
            d = _differs(a[k], b[k], str(k))
            if d is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return key or "?"
        for x, y in zip(a, b):
            d = _differs(x, y, key)
            if d is not None:
                return d
        return None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and (torch.equal(a, b) or (
            a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())))
        return None if same else (key or "?")
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return key or "?"
    if type(a) is not type(b):
        return key or "?"
    if hasattr(a, "__dict__") and not isinstance(a, type) and not callable(a):
        return _differs(vars(a), vars(b), key)  # an object a class keeps in its state (a preconditioner)
    try:
        return None if a == b or (a != a and b != b) else (key or "?")
    except Exception:  # values without a usable ==: compared by type only
        return None

"""What an inner optimizer may do to be stepped one bucket at a time, checked once per param group at construction.

Stepping bucket by bucket equals the standard loop only when the class's step for a tensor depends on that tensor's
gradient and state alone, and on group-level state the stepper carries (``_stepper.step_inner_optimizers``). A
class torch does not ship is checked by behaviour: it is stepped on small probe tensors shaped like the group's,
once as the standard loop does and once one tensor at a time in backward's order, and both must agree bitwise.
A class that does not is refused with the reason, unless every step is one ``step()`` over all of its groups.
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from dist_optim._inputs import is_dtensor
from dist_optim._torch_internals import LR_SCHEDULER_STEP_MARK

__all__: list[str] = []

PROBE_STEPS = 3  # enough for a counter written at the first step and read at the next, and a warm-up branch
PROBE_TENSORS = 3  # per group: a step coupling tensors shows with two; three catch "first"/"last" special cases
PROBE_DIM = 6  # each dimension of a probe is min(the parameter's, this): small, and above the ranks of factored
# classes' defaults (Adafactor-style row/column factors, Muon's 2-D test)


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


def check_bucketable(
    cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any], one_step: bool
) -> None:
    """Refuse ``cls`` for ``group`` (a group the class filled) unless stepping it per bucket is its standard step.

    Args:
        one_step: every training step is one call over all of this class's groups (``bucket_cap_mb=inf`` on one
            process): then only what a single call cannot do is checked.

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
            reason = _compare(cls, group, kwargs, tensors, split=not one_step)
        except Exception as e:  # a class that fails on the probe cannot be shown to be exact: refused with why
            first = str(e).splitlines()[0] if str(e) else ""
            raise NotImplementedError(
                f"{name} cannot be stepped by InBackwardOptimizer: stepping it as its standard loop would, on "
                f"small tensors like this group's, raised {type(e).__name__}: {first} (a class that needs a "
                "closure, second-order gradients or tensors of other shapes cannot be checked). Use it with a "
                "standard training loop"
            ) from e
    if reason is None:
        return
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


def _compare(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any],
             like: list[torch.Tensor], split: bool) -> str | None:
    """``None`` if the standard step and the per-tensor step agree bitwise on probes, else what differs.
    ``split=False``: only what one step over all tensors cannot carry either (the class's own counters)."""
    from dist_optim._stepper import Recipe, hyperparameters, step_inner_optimizers, unwrapped_step

    options = hyperparameters(group)
    shapes = [_probe_shape(like[k % len(like)]) for k in range(PROBE_TENSORS)]
    kind = like[0]
    gen = torch.Generator(device=kind.device).manual_seed(0)
    start = [torch.randn(s, generator=gen, device=kind.device).to(kind.dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, device=kind.device).to(kind.dtype) for s in shapes]
             for _ in range(PROBE_STEPS)]

    def leaves() -> list[torch.Tensor]:
        return [_as_kind(t.clone(), kind).requires_grad_(True) for t in start]

    # the standard loop
    torch.manual_seed(0)
    ref_params = leaves()
    ref = cls([{**options, "params": ref_params}], **kwargs)
    modes = [m for m in MODE_SWITCHES if callable(getattr(cls, m, None))]
    if "train" in modes:
        cls.train(ref)  # type: ignore[attr-defined]
    counters: dict[str, Any] = {}
    for k, step_grads in enumerate(grads):
        for p, g in zip(ref_params, step_grads):
            p.grad = _as_kind(g.clone(), kind)
        unwrapped_step(cls)(ref)  # not ref.step(): global step hooks must not see the probe
        if k == 0:
            counters = _attributes(ref)
    moved = [k for k, v in _attributes(ref).items() if k not in counters or _differs(counters[k], v)]
    if moved:
        return (f"{_OWN_ATTRIBUTE} {moved[0]!r}, which changes at every step, outside its param groups and "
                "per-tensor state (each bucket's optimizer would keep its own copy)")
    if not split:
        return None
    # one tensor per bucket, in backward's order, through the stepper
    torch.manual_seed(0)
    params = leaves()
    built = cls([{**options, "params": params}], **kwargs)  # as add_param_group fills a group
    facade_group = built.param_groups[0]
    owner = types.SimpleNamespace(param_groups=[facade_group], state=defaultdict(dict))
    owner.state.update(built.state)  # state some classes create at construction
    recipe = Recipe(owner, cls, kwargs)  # type: ignore[arg-type]
    recipe.classes, recipe.kernels = [cls], [{}]
    buckets = [recipe.build([(0, False, [p])]) for p in reversed(params)]
    if "train" in modes:
        switch_mode(cls, "train", owner.param_groups, owner.state, ref.defaults)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = _as_kind(g.clone(), kind)
        started: dict[int, dict[str, Any]] = {}
        for inners in buckets:
            step_inner_optimizers(inners, started)
    if "eval" in modes:  # what a user evaluates (schedule-free: the averaged point) must agree as well
        cls.eval(ref)  # type: ignore[attr-defined]
        switch_mode(cls, "eval", owner.param_groups, owner.state, ref.defaults)
    for k, (a, b) in enumerate(zip(ref_params, params)):
        if not torch.equal(a, b):
            return f"its parameters differ after {PROBE_STEPS} steps when the tensors are stepped one at a time " \
                   "(the step couples tensors: a norm, mean or count over the group, or random draws in order)"
        diff = _differs(ref.state.get(a, {}), owner.state.get(b, {}))
        if diff:
            return f"its per-tensor state {diff!r} differs when the tensors are stepped one at a time"
    extra_ref = {k: v for k, v in ref.state.items() if not isinstance(k, torch.Tensor)}
    extra = {k: v for k, v in owner.state.items() if not isinstance(k, torch.Tensor)}
    diff = _differs(extra_ref, extra)
    if diff:
        return f"it keeps state {diff!r} outside its tensors' entries, which advances once per bucket"
    diff = _differs(hyperparameters(ref.param_groups[0]), hyperparameters(facade_group))
    if diff:
        return f"its param group's {diff!r} depends on which tensors a step() call sees"
    return None


_TORCH_ATTRIBUTES = frozenset(torch.optim.SGD([torch.zeros(1, requires_grad=True)]).__dict__) | {LR_SCHEDULER_STEP_MARK}


def _attributes(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own attributes that hold numbers or tensors (where a counter would live), copied."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(opt).items()
            if k not in _TORCH_ATTRIBUTES and isinstance(v, (bool, int, float, str, torch.Tensor))}


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

"""How a bucket of parameters is stepped: its inner ``torch.optim`` optimizers, their kernel, DTensor shards.

Inner optimizers are built here and nowhere else (:meth:`Recipe.build`), one per optimizer class in a bucket, with
the facade's ``state`` and its live groups copied in before every step, and what a class writes into its groups
copied back once per training step (:func:`step_inner_optimizers`). For torch's classes the kernel is torch's
fastest one that runs on the tensors (``fused``, else ``foreach``); other classes keep their own default. Fused
Adam and torchao's Adam classes call their kernel directly (``_direct_steps``). Buckets of
DTensor shards for elementwise optimizers are stepped on their local tensors, which saves DTensor's dispatch per
call, while the facade keeps the state as DTensors. A DTensor whose gradient's placements differ from its own (a
``Replicate`` norm weight with a ``Partial`` gradient under SequenceParallel) is stepped through DTensor's ops
instead, which redistribute as the standard loop's do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from dist_optim._torch_internals import LOCAL_TENSOR, local_tensor
from dist_optim.engine._classes import check_takes_params, hyperparameters, is_torch_step, no_rng, unwrapped_step
from dist_optim.engine._direct_steps import (
    FUSED_ADAM,
    FusedAdamStep,
    TorchaoAdamStep,
    one_kind,
    torchao_adam_function,
    torchao_version,
)
from dist_optim.engine._inputs import is_dtensor

__all__: list[str] = []

# Optimizers whose step is elementwise given the hyperparameters (no norm or reduction over a tensor).
ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
})


class GroupLink(NamedTuple):
    """One param group of an inner optimizer and where its options come from before each step."""

    inner: dict[str, Any]  # the inner optimizer's group
    facade: dict[str, Any]  # the facade's live group: an LR scheduler's or a manual change reaches the next step
    fixed: dict[str, Any]  # what the facade's group must not overwrite: the bucket's tensors, the chosen kernel


class InnerOptimizer(NamedTuple):
    """A ``torch.optim`` optimizer over one bucket's parameters of one optimizer class."""

    optimizer: torch.optim.Optimizer
    step: Callable[[torch.optim.Optimizer], Any]  # its unwrapped step, or that step run on local shards
    groups: list[GroupLink]
    carries: bool = True  # whether its class may write into its groups (torch's own step writes nothing)


def step_inner_optimizers(inners: list[InnerOptimizer], started: dict[int, dict[str, Any]]) -> None:
    """Step a bucket's inner optimizers, carrying group-level state (keys a class writes into its groups: step
    counters, D-Adaptation's ``d``, schedule-free's ``k``) as one copy per facade group.

    ``started`` maps ``id(facade group)`` to that group's options as they were before its first bucket of this
    training step (the caller empties it when a training step begins). The first bucket of a group steps on the
    facade's values and writes what the class wrote back into the facade group; every later bucket of that group
    steps on the values from before the step, as the standard loop's single ``step()`` call sees them for all of
    the group's tensors, so a counter the class advances per call advances once per training step. That the
    class writes the same values whichever tensors it stepped is what :func:`dist_optim.engine._rule.check_bucketable`
    checked at construction.
    """
    for inner in inners:
        if not inner.carries:
            for link in inner.groups:
                link.inner.update(link.facade)
                link.inner.update(link.fixed)
            inner.step(inner.optimizer)
            continue
        first = []
        for link in inner.groups:
            before = started.get(id(link.facade))
            if before is None:
                started[id(link.facade)] = _snapshot(link.facade)
                _mirror(link.inner, link.facade, link.fixed)
                first.append(link)
            else:
                _mirror(link.inner, _snapshot(before), link.fixed)
        inner.step(inner.optimizer)
        for link in first:
            for k, v in link.inner.items():
                if k not in link.fixed:
                    link.facade[k] = v


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    """A group's options as they are now: tensors (a counter the class advances in place) cloned."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k not in _TENSORS}


_TENSORS = ("params", "param_names")


def _mirror(inner: dict[str, Any], source: dict[str, Any], fixed: dict[str, Any]) -> None:
    """Make ``inner`` the group ``source`` describes, but for ``fixed`` (the bucket's tensors, the kernel)."""
    for k in [k for k in inner if k not in source and k not in fixed]:
        del inner[k]
    inner.update({k: v for k, v in source.items() if k not in _TENSORS})
    inner.update(fixed)


class Recipe:
    """What inner optimizers are built from: the owner's live ``param_groups`` and ``state`` (both may be replaced,
    by ``load_state_dict``), each group's optimizer class and the kernel chosen for it."""

    def __init__(
        self, owner: torch.optim.Optimizer, optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]
    ) -> None:
        self.owner = owner
        self.optimizer_class = optimizer_class
        self.kwargs = dict(kwargs)
        self.classes: list[type[torch.optim.Optimizer]] = []  # per group
        self.kernels: list[dict[str, Any]] = []  # per group: {"fused": True}, {"foreach": True} or {}
        self.one_step = False  # every training step is one call per class over all its groups (one bucket)
        self.random_draws = "exact"  # InBackwardOptions.random_draws: "reordered" accepts draws reordered per bucket
        self.reordering_refused: str | None = None  # why this setting cannot reorder draws (DDP's; None: it can)
        self.started: dict[int, dict[str, Any]] = {}  # this training step: id(facade group) -> its options before

    def kwargs_for(self, cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
        """A group with its own class takes its options from the group and that class's defaults."""
        return self.kwargs if cls is self.optimizer_class else {}

    def defaults(self, like: torch.Tensor, groups: list[Any]) -> dict[str, Any]:
        """``optimizer_class``'s defaults with the user's options, built on a tensor of ``like``'s kind, else (a
        class that reads keys of the user's groups, such as Muon's ``use_muon``) on the user's groups."""
        check_takes_params(self.optimizer_class)
        dummy = torch.zeros(1, 1, dtype=like.dtype, device=like.device, requires_grad=True)
        with no_rng([like]):
            try:
                return dict(self.optimizer_class([dummy], **self.kwargs).defaults)
            except Exception:
                if is_torch_step(self.optimizer_class):
                    raise  # torch's classes build on any tensor: the error is the user's options'
            mine = [g for g in groups if not (isinstance(g, dict) and "optimizer_class" in g)]
            return dict(self.optimizer_class(mine, **self.kwargs).defaults)

    def fill(self, cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> torch.optim.Optimizer:
        """An optimizer over ``group`` alone: ``cls`` fills in its defaults and checks its options and tensors."""
        return cls([group], **self.kwargs_for(cls))

    def add_group(self, cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> None:
        self.classes.append(cls)
        self.kernels.append(choose_kernel(cls, group, self.kwargs_for(cls)))

    def choose_kernels(self) -> None:
        """Choose again for groups that were replaced (a loaded state dict brings its own flags)."""
        self.kernels = [
            choose_kernel(cls, g, self.kwargs_for(cls)) for cls, g in zip(self.classes, self.owner.param_groups)
        ]

    def build(self, parts: list[tuple[int, bool, list[torch.Tensor]]]) -> list[InnerOptimizer]:
        """The inner optimizers of a bucket given as ``(group index, sparse gradients?, tensors)`` parts. Sparse
        gradients take the for-loop, the one path torch has for them."""
        groups, state = self.owner.param_groups, self.owner.state
        # An inner optimizer never mixes device meshes, nor DTensors with plain tensors: DTensor's foreach and fused
        # ops refuse such lists (plain tensors next to DTensors: allow_local_steps under tensor parallel)
        by_class: dict[tuple[type, Any], list[tuple[int, bool, list[torch.Tensor]]]] = {}
        positions: dict[int, dict[int, int]] = {}  # group index -> id(param) -> its place in the group
        for gi, sparse, ps in sorted(parts, key=lambda part: part[:2]):
            if gi not in positions:
                positions[gi] = {id(p): k for k, p in enumerate(groups[gi]["params"])}
            # the group's order, not arrival order: a class that sums or draws over its tensors does it in the order
            # the standard loop does (one bucket is then that loop's step)
            ps = sorted(ps, key=lambda p: positions[gi].get(id(p), 0))
            meshes = [p.device_mesh if is_dtensor(p) else None for p in ps]
            for mesh in dict.fromkeys(meshes):
                part = (gi, sparse, ps if len(set(meshes)) == 1 else [p for p, m in zip(ps, meshes) if m == mesh])
                by_class.setdefault((self.classes[gi], mesh), []).append(part)
        inners = []
        for (cls, _), cls_parts in by_class.items():
            params = [p for _, _, ps in cls_parts for p in ps]
            shards = LocalShards(params) if can_step_locally(cls, params) else None
            fixed = [{} if sparse else self.kernels[gi] for gi, sparse, _ in cls_parts]
            inner_groups = [
                {**hyperparameters(groups[gi]), "params": ps if shards is None else shards.stand_ins_of(ps), **k}
                for (gi, _, ps), k in zip(cls_parts, fixed)
            ]
            optimizer = cls(inner_groups, **self.kwargs_for(cls))
            optimizer.state = state if shards is None else shards.state
            links = [
                GroupLink(ig, groups[gi], {"params": ig["params"], **k})
                for ig, (gi, _, _), k in zip(optimizer.param_groups, cls_parts, fixed)
            ]
            step = unwrapped_step(cls)
            if shards is not None:
                dtensor_path = DTensorPath(cls, self.kwargs_for(cls), [
                    (groups[gi], k, ps) for (gi, _, ps), k in zip(cls_parts, fixed)], state, self.started)
                step = shards.stepper(step, state, dtensor_path)
            elif cls in FUSED_ADAM and all(k.get("fused") or g.get("fused") for k, g in zip(
                    fixed, (groups[gi] for gi, _, _ in cls_parts))) and one_kind(params):
                step = FusedAdamStep(step, cls is torch.optim.AdamW, optimizer)
            elif (function := torchao_adam_function(cls, torchao_version())) is not None:
                step = TorchaoAdamStep(step, function)
            inners.append(InnerOptimizer(optimizer, step, links, not is_torch_step(cls)))
        return inners


# -- the kernel ---------------------------------------------------------------------------------------------------
def choose_kernel(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pick ``fused`` (else ``foreach``) for a group whose user left both unset, if it runs on these tensors; a
    class that does not step with torch's own step keeps its own default (its ``None`` may mean something else)."""
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return {}
    if not is_torch_step(cls):
        return {}
    for flag in ("fused", "foreach"):
        if flag == "fused" and issubclass(cls, torch.optim.SGD):
            # torch's fused SGD fails on a group where some momentum buffers exist and some do not yet (a parameter
            # unused so far, or a layer added to a resumed model), which foreach and the for-loop handle.
            continue
        if flag in group and kernel_runs(cls, group, kwargs, flag):
            return {flag: True}
    return {}


def kernel_runs(cls: type[torch.optim.Optimizer], group: dict[str, Any], kwargs: dict[str, Any], flag: str) -> bool:
    """Whether ``cls`` steps with ``flag=True`` on tiny tensors like this group's (some refuse only at step)."""
    probes = []
    seen = set()
    for p in group["params"]:
        key = (p.dtype, p.device, p.ndim, type(p), getattr(p, "device_mesh", None))
        if key not in seen:
            seen.add(key)
            probes.append(_probe_like(p))
    try:
        with no_rng(probes):
            opt = cls([{**hyperparameters(group), "params": probes, flag: True}], **kwargs)
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


# -- DTensor shards -----------------------------------------------------------------------------------------------
def can_step_locally(cls: type, params: list[torch.Tensor]) -> bool:
    """An elementwise optimizer does on a DTensor exactly what it does on the local shard (DTensor dispatches each
    foreach/fused call to the same kernel on the local tensors), without paying the dispatch."""
    return cls in ELEMENTWISE and all(is_dtensor(p) and hasattr(p, LOCAL_TENSOR) for p in params)


class LocalShards:
    """Stand-ins for the local shards of some DTensor parameters, and the local view of their state."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.stand_ins = {id(p): local_tensor(p).detach() for p in params}
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)  # the inner optimizer's
        self._seen: dict[int, dict[str, Any]] = {}  # id(param) -> the facade state dict its local view came from

    def stand_ins_of(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.stand_ins[id(p)] for p in params]

    def stepper(self, step: Callable[[torch.optim.Optimizer], Any], facade_state: dict,
                dtensor_path: DTensorPath) -> Callable[..., Any]:
        def run(inner: torch.optim.Optimizer) -> None:
            new = []
            redistributed = []  # tensors whose gradient is laid out otherwise than they are: DTensor's ops step them
            local_grads = 0
            for p in self.params:
                a = self.stand_ins[id(p)]
                local = local_tensor(p)
                if a.data_ptr() != local.data_ptr() or a.shape != local.shape:
                    a.data = local  # FSDP2 re-created the shard (module.to(), lazy init): follow it
                g = p.grad
                if g is None or not same_layout(p, g):
                    a.grad = None
                    if g is not None:
                        redistributed.append(p)
                    continue
                a.grad = local_tensor(g)
                local_grads += 1
                mine = facade_state.get(p)
                if not mine:
                    self.state.pop(a, None)
                    new.append(p)
                elif mine is not self._seen.get(id(p)):  # new, or replaced (load_state_dict, a standard step)
                    self.state[a] = {k: local_tensor(v) if is_dtensor(v) else v for k, v in mine.items()}
                    self._seen[id(p)] = mine
            try:
                if local_grads:
                    step(inner)
                if redistributed:
                    dtensor_path.step(redistributed)
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
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape != local_tensor(p).shape:
        return v  # a scalar (``step``): a plain tensor in the standard loop too
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def same_layout(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether a DTensor ``p``'s gradient has ``p``'s mesh and placements, so that its local tensor is the gradient
    of ``p``'s local shard (a ``Partial`` gradient holds only this rank's term of a sum)."""
    return is_dtensor(grad) and grad.placements == p.placements and grad.device_mesh == p.device_mesh


class DTensorPath:
    """The step, through DTensor's ops, of tensors whose gradient is not laid out as they are.

    The standard loop's optimizer gets a ``Partial`` gradient for a ``Replicate`` parameter and DTensor redistributes
    it inside each op that reads it (for SGD with weight decay, ``grad + wd * p`` is formed on the partial terms,
    then reduced: not the same bits as reducing first). Stepping those tensors with the same class, kernel and ops
    on the DTensors is that arithmetic exactly. Its inner optimizer is built the first time a set of tensors needs
    it (the same set every step, in a given model); the state is the facade's own."""

    def __init__(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 parts: list[tuple[dict[str, Any], dict[str, Any], list[torch.Tensor]]], state: dict,
                 started: dict[int, dict[str, Any]]) -> None:
        self.cls = cls
        self.kwargs = kwargs
        self.parts = parts  # (the facade's live group, the kernel fixed for it, the bucket's tensors of that group)
        self.state = state
        self.started = started  # the recipe's: group-level state carried once per facade group and training step
        self._built: dict[tuple[int, ...], InnerOptimizer] = {}

    def step(self, params: list[torch.Tensor]) -> None:
        key = tuple(id(p) for p in params)
        inner = self._built.get(key)
        if inner is None:
            inner = self._built[key] = self._build({id(p) for p in params})
        step_inner_optimizers([inner], self.started)

    def _build(self, wanted: set[int]) -> InnerOptimizer:
        parts = [(facade, fixed, [p for p in ps if id(p) in wanted]) for facade, fixed, ps in self.parts]
        parts = [part for part in parts if part[2]]
        optimizer = self.cls([{**hyperparameters(facade), "params": ps, **fixed} for facade, fixed, ps in parts],
                             **self.kwargs)
        optimizer.state = self.state
        links = [GroupLink(ig, facade, {"params": ig["params"], **fixed})
                 for ig, (facade, fixed, _) in zip(optimizer.param_groups, parts)]
        return InnerOptimizer(optimizer, unwrapped_step(self.cls), links)

"""Make it fit: the settings of a job that keep each device under a memory budget, ranked by estimated step time.

:func:`fit_settings` searches settings the caller lists, given how to plan each (``plan_for``: ``plan()``'s
arguments); :func:`fit` lists them for a model, a global batch and a world (layouts, micro-batch x accumulation,
activation checkpointing per block, parameter dtype, autocast, optimizer-state precision, clip mode, bucket cap).

Not every setting is traced. Memory is additive in its parts, and each part scales simply: parameters, gradients
and optimizer state do not depend on the micro-batch; activations grow linearly with it and with the number of
blocks not checkpointed. So, per group of settings that differ only in micro-batch and checkpointing (and whether
they accumulate, which holds every gradient), the smallest and largest micro-batch are traced with no block and
with every block checkpointed; the rest are interpolated linearly ("derived"). Those ranked best are then traced
themselves before one is recommended, and a setting whose parameters alone exceed the budget is not traced at all
("bound"). Cost: the traced warm step's FLOPs (``FlopCounterMode``: the recomputation of checkpointed blocks and
``two_pass``'s second backward are in it, as run) at the device's peak, plus the bytes its collectives move over
the device's link; the two are added (no overlap assumed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_optim._planner._fit_types import (
    ALLOW,
    DEVICES,
    FitCandidate,
    FitResult,
    FitSetting,
    parse_memory,
)
from dist_optim._planner._fsdp2 import default_units
from dist_optim._planner._plan import trace_in_backward
from dist_optim._torch_internals import FakeTensorMode

__all__: list[str] = []

logger = logging.getLogger(__name__)
HEADROOM = 0.10  # docs/planning.md, "Make it fit": what the plan cannot see, on CUDA


def fit_settings(settings: Sequence[FitSetting], plan_for: Callable[[FitSetting], dict[str, Any]], *,
                 memory: int | float | str, params_bytes: Callable[[FitSetting], int] | None = None,
                 headroom: float = HEADROOM, device: str = "auto", verify: int = 3,
                 argv_for: Callable[[FitSetting], list[str]] | None = None) -> FitResult:
    """Plan each of ``settings`` (traced or derived, see the module's docstring), keep those under ``memory``
    less ``headroom``, rank them by estimated step time, and trace the best ``verify`` themselves.

    ``plan_for(setting)`` gives :func:`dist_optim.plan`'s arguments for the setting (not ``"pp"``);
    ``params_bytes(setting)``, if given, the bytes of parameters one device holds, a bound that spares a trace;
    ``argv_for(setting)`` the command line that runs it (kept in each candidate)."""
    budget = parse_memory(memory)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}: the fraction of the budget kept free")
    device = _device(device)
    t0 = time.perf_counter()
    search = _Search(plan_for, device)
    search.plan_groups(settings)
    usable = int(budget * (1 - headroom))
    out = []
    for s in dict.fromkeys(settings):  # in order, once each
        bound = params_bytes(s) if params_bytes is not None else 0
        c = FitCandidate(s, bound, "bound") if bound > usable else search.candidate(s)
        c.argv = argv_for(s) if argv_for is not None else []
        out.append(c)
    for _ in range(len(out)):  # the best that fit, traced themselves; then ranked again
        _rank(out, usable)
        derived = [i for i, c in enumerate(out[:verify]) if c.fits and c.planned_by == "derived"]
        if not derived:
            break
        for i in derived:
            traced = search.traced(out[i].setting)
            out[i] = dataclasses.replace(traced, argv=out[i].argv)
    _rank(out, usable)
    if all(c.planned_by == "bound" for c in out):  # the smallest figure said is a plan, not a bound
        i = min(range(len(out)), key=lambda i: out[i].planned_peak_bytes)
        out[i] = dataclasses.replace(search.traced(out[i].setting), argv=out[i].argv)
        _rank(out, usable)
    return FitResult(budget, headroom, out, device, search.count, round(time.perf_counter() - t0, 1))


def _rank(candidates: list[FitCandidate], usable: int) -> None:
    for c in candidates:
        c.fits = c.planned_by != "bound" and c.planned_peak_bytes <= usable
    candidates.sort(key=lambda c: (not c.fits, c.cost_seconds if c.fits else c.planned_peak_bytes,
                                   c.planned_peak_bytes))


def _device(device: str) -> str:
    if device == "auto":
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name().lower()
            return next((k for k in DEVICES if k in name), "h100")
        return "cpu"
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto' or one of {sorted(DEVICES)}, got {device!r}")
    return device


class _Search:
    """Traces on demand, each setting once, and derives the others from them."""

    def __init__(self, plan_for: Callable[[FitSetting], dict[str, Any]], device: str) -> None:
        self.plan_for, self.device, self.count = plan_for, device, 0
        self.memo: dict[FitSetting, FitCandidate] = {}
        self.group_of: dict[FitSetting, tuple[int, int, int, int]] = {}

    def traced(self, s: FitSetting) -> FitCandidate:
        if s not in self.memo or self.memo[s].planned_by != "traced":
            logger.info("fit: tracing %s", s.describe())
            plan, n_params = trace_in_backward(**self.plan_for(s))
            self.count += 1
            flops, comm = plan.counts["flops"], plan.counts["collective_bytes"]
            if s.parallel == "ddp":  # the planner's DDP reduces without a collective: a ring all-reduce's bytes
                comm += 2 * n_params * (2 if s.param_dtype == "bfloat16" else 4)
            self.memo[s] = FitCandidate(s, plan.run_peak_bytes, "traced", flops=flops, collective_bytes=comm,
                                        cost_seconds=self.seconds(s, flops, comm))
        return self.memo[s]

    def seconds(self, s: FitSetting, flops: float, comm: float) -> float:
        fp32, bf16, intra, inter = DEVICES[self.device]
        peak = bf16 if s.param_dtype != "float32" or s.autocast else fp32
        link = intra if s.world_size <= 8 else inter  # a node of up to 8 devices
        return flops / peak + comm / link

    def candidate(self, s: FitSetting) -> FitCandidate:
        """``s`` derived from up to four traced settings of its group (or traced, when it is one of them)."""
        group = self.group_of.get(s)
        if group is None:
            return self.traced(s)
        micro_lo, micro_hi, k_lo, k_hi = group
        corners = {(m, k): self.traced(_at(s, m, k)) for m in {micro_lo, micro_hi} for k in {k_lo, k_hi}}
        if (s.micro_batch, s.checkpoint_blocks) in corners:
            return corners[s.micro_batch, s.checkpoint_blocks]

        def value(get: Callable[[FitCandidate], float]) -> float:
            def at_k(m: int) -> float:
                ks = sorted(k for mm, k in corners if mm == m)
                lo, hi = ks[0], ks[-1]
                w = 0.0 if hi == lo else (s.checkpoint_blocks - lo) / (hi - lo)
                return (1 - w) * get(corners[m, lo]) + w * get(corners[m, hi])
            w = 0.0 if micro_hi == micro_lo else (s.micro_batch - micro_lo) / (micro_hi - micro_lo)
            return (1 - w) * at_k(micro_lo) + w * at_k(micro_hi)
        flops, comm = value(lambda c: c.flops), value(lambda c: c.collective_bytes)
        return FitCandidate(s, int(value(lambda c: c.planned_peak_bytes)), "derived", flops=flops,
                            collective_bytes=comm, cost_seconds=self.seconds(s, flops, comm))

    def plan_groups(self, settings: Sequence[FitSetting]) -> None:
        """Group ``settings`` that differ only in micro-batch and checkpointing (and accumulate alike): each is
        derived from its group's smallest and largest micro-batch, at its fewest and most checkpointed blocks."""
        groups: dict[FitSetting, list[FitSetting]] = {}
        for s in settings:
            groups.setdefault(_at(s, 0, 0, accumulating=s.accumulation_steps > 1), []).append(s)
        self.group_of = {}
        for members in groups.values():
            micros = sorted({s.micro_batch for s in members})
            ks = sorted({s.checkpoint_blocks for s in members})
            for s in members:
                self.group_of[s] = (micros[0], micros[-1], ks[0], ks[-1])


def _at(s: FitSetting, micro: int, blocks: int, accumulating: bool | None = None) -> FitSetting:
    """``s`` at another micro-batch (the same samples per step) and checkpointing; ``accumulating`` given: the
    group's key (micro-batch and accumulation blanked, only whether it accumulates kept)."""
    if accumulating is not None:
        return dataclasses.replace(s, micro_batch=0, accumulation_steps=2 if accumulating else 1,
                                   checkpoint_blocks=0)
    per_rank = s.micro_batch * s.accumulation_steps
    return dataclasses.replace(s, micro_batch=micro, accumulation_steps=per_rank // micro, checkpoint_blocks=blocks)


# -- fit(): the settings of a model ----------------------------------------------------------------------------------
def checkpoint_first(model: nn.Module, n: int) -> nn.Module:
    """``model`` with the first ``n`` of its blocks (the entries of the ``nn.ModuleList`` holding the most
    parameters) recomputing their forward in backward (``torch.utils.checkpoint``, non-reentrant). Each block's
    ``forward`` is wrapped in place, so that the model's structure (its names, a tensor-parallel plan's paths) stays
    as it was."""
    if n:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        for block in list(blocks)[:n]:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(devices: int, nodes: int, parallelize: Any) -> list[tuple[str, int | None, int | None]]:
    """(parallel, tp_size, shard_size) of each layout the world allows: one device alone; DDP and FSDP2 over all;
    HSDP sharded within a node over several nodes; with ``parallelize``, TP within a node and FSDP2 x TP."""
    world = devices * nodes
    if world == 1:
        return [("none", None, None)]
    out: list[tuple[str, int | None, int | None]] = [("ddp", None, None), ("fsdp2", None, None)]
    if nodes > 1 and devices > 1:
        out.append(("hsdp", None, devices))
    if parallelize is not None:
        if nodes == 1:
            out.append(("tp", None, None))
        out += [("fsdp2+tp", t, None) for t in _divisors(devices) if 1 < t < world]
    return out


def fit(model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *, memory: int | float | str,
        global_batch: int, devices: int = 1, nodes: int = 1, allow: Sequence[str] | str = (),
        max_grad_norm: float | None = None, headroom: float = HEADROOM, device: str = "auto",
        parallelize: Callable[[nn.Module, Any], Any] | None = None,
        fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None,
        bucket_caps: Sequence[float | None] = (None,), verify: int = 3, **optimizer_kwargs: Any) -> FitResult:
    """The settings of a training job that keep each device under ``memory``, ranked by estimated step time.

    Searched, where the world allows (``devices`` per node, ``nodes``): the layout (one device; DDP, FSDP2; HSDP
    over several nodes; with ``parallelize``, TP within a node and FSDP2 x TP), the micro-batch and accumulation
    that make ``global_batch`` samples per optimizer step, activation checkpointing of none, half or all of the
    model's blocks (the entries of its largest ``nn.ModuleList``), with ``max_grad_norm`` the clip mode
    (``two_pass`` or ``exact``), and ``bucket_caps``. By default only settings bitwise equal to the standard loop of
    the job asked for are candidates; ``allow`` widens that: ``"bf16-params"`` (parameters, gradients and state in
    bfloat16), ``"autocast"`` (the forward under bfloat16 autocast), ``"low-bit-states"`` (torchao's
    ``AdamW8bit``/``AdamW4bit`` for ``AdamW``, where installed). Each candidate's peak per device is the larger of
    the first step's and a warm step's, traced on fake tensors or derived (the module's docstring; docs/planning.md,
    "Make it fit").

    Args:
        model_fn: builds the model (under ``FakeTensorMode``, as for :func:`dist_optim.plan`).
        batch_fn: ``batch_fn(n)`` makes a micro-batch of ``n`` samples (under ``FakeTensorMode``).
        loss_fn: ``loss_fn(model, batch)``.
        optimizer_class, optimizer_kwargs: the optimizer.
        memory: the budget per device: bytes, or a size such as ``"80GiB"``.
        global_batch: samples per optimizer step over the whole job.
        devices, nodes: the world: ``devices`` per node.
        allow: names (or one comma-separated string) of the settings that change the job's arithmetic.
        max_grad_norm: the job clips to this global norm.
        headroom: the fraction of ``memory`` kept free for what the plan does not see (default 10 %).
        device: the cost model's device: ``"auto"`` (the CUDA device's name, else ``"cpu"``), ``"h100"``,
            ``"a100"``, ``"l4"``, ``"cpu"``.
        parallelize, fsdp_units: as for :func:`dist_optim.plan`.
        bucket_caps: the in-backward bucket caps searched (``None``: the default).
        verify: the best candidates traced themselves before the ranking is final.

    Returns:
        A :class:`FitResult`: ``best`` (``None`` when nothing fits; then ``smallest_budget_bytes()``), every
        candidate, ``table()``, ``to_dict()``, ``plot(path)``.

    Example:
        >>> import torch, dist_optim
        >>> r = dist_optim.fit(lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)),
        ...                    lambda n: torch.randn(n, 256), lambda m, x: m(x).square().mean(),
        ...                    memory="4MiB", global_batch=64, lr=1e-3)
        >>> r.fits, r.best.setting.micro_batch * r.best.setting.accumulation_steps
        (True, 64)
    """
    names = tuple(a for a in (allow.split(",") if isinstance(allow, str) else allow) if a)
    unknown = [a for a in names if a not in ALLOW]
    if unknown:
        raise ValueError(f"allow names {', '.join(map(repr, unknown))}, not among {', '.join(ALLOW)}")
    for name, value in (("devices", devices), ("nodes", nodes), ("global_batch", global_batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    with FakeTensorMode(), _fake_copies():
        model = model_fn()
        n_blocks = len((fsdp_units or default_units)(model))
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    world = devices * nodes
    states = {"full": optimizer_class, **(_low_bit(optimizer_class) if "low-bit-states" in names else {})}
    dtypes = [("float32", None)] + [("bfloat16", None)] * ("bf16-params" in names) + \
        [("float32", "bfloat16")] * ("autocast" in names)
    settings, skipped = [], []
    for parallel, tp, shard in layouts(devices, nodes, parallelize):
        replicas = 1 if parallel == "tp" else world // (tp or 1)
        if global_batch % replicas:
            skipped.append(f"{parallel}: global_batch {global_batch} is not a multiple of its {replicas} replicas")
            continue
        per = global_batch // replicas
        # accumulation is planned on one device, DDP and FSDP2 (plan()); the others take the whole batch at once
        micros = _divisors(per) if parallel in ("none", "ddp", "fsdp2") else [per]
        for m in micros:
            for k in sorted({0, n_blocks // 2, n_blocks}):
                for (dtype, autocast), state, clip, cap in _product(dtypes, states, max_grad_norm, bucket_caps):
                    settings.append(FitSetting(parallel, world, tp, shard, m, per // m, k, dtype, autocast, state,
                                               clip, cap))
    shards = {"none": 1, "ddp": 1, "hsdp": devices}

    def params_bytes(s: FitSetting) -> int:
        return n_params * (2 if s.param_dtype == "bfloat16" else 4) // shards.get(s.parallel, world)

    def plan_for(s: FitSetting) -> dict[str, Any]:
        return _plan_arguments(s, model_fn, batch_fn, loss_fn, states[s.state], parallelize, fsdp_units,
                               max_grad_norm, optimizer_kwargs)
    result = fit_settings(settings, plan_for, memory=memory, params_bytes=params_bytes, headroom=headroom,
                          device=device, verify=verify)
    result.skipped = skipped
    for c in result.candidates:
        c.call = _call(c.setting, states[c.setting.state], max_grad_norm, optimizer_kwargs)
    return result


def _product(dtypes: list, states: dict, max_grad_norm: float | None, caps: Sequence[float | None]) -> list:
    clips = [None] if max_grad_norm is None else ["two_pass", "exact"]
    return [(d, st, c, cap) for d in dtypes for st in states for c in clips for cap in caps]


def _low_bit(optimizer_class: type) -> dict[str, type]:
    if optimizer_class is not torch.optim.AdamW:
        return {}
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError:
        return {}
    return {"8bit": AdamW8bit, "4bit": AdamW4bit}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _fake_copies() -> Any:
    from dist_optim._planner._guard import FakeCopies

    return FakeCopies()


def _plan_arguments(s: FitSetting, model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], Any],
                    loss_fn: Callable[..., torch.Tensor], cls: type, parallelize: Any, fsdp_units: Any,
                    max_grad_norm: float | None, optimizer_kwargs: dict[str, Any]) -> dict[str, Any]:
    def build() -> nn.Module:
        with _default_dtype(getattr(torch, s.param_dtype)):
            return checkpoint_first(model_fn(), s.checkpoint_blocks)
    out: dict[str, Any] = dict(model_fn=build, batch_fn=lambda: batch_fn(s.micro_batch), loss_fn=loss_fn,
                               optimizer_class=cls, parallel=s.parallel, world_size=s.world_size,
                               accumulation_steps=s.accumulation_steps, **optimizer_kwargs)
    if s.autocast:
        out["autocast_dtype"] = getattr(torch, s.autocast)
    if s.parallel in ("fsdp2", "hsdp", "fsdp2+tp") and fsdp_units is not None:
        out["fsdp_units"] = fsdp_units
    if s.parallel in ("tp", "fsdp2+tp"):
        out["parallelize"] = parallelize
    out.update({k: v for k, v in (("tp_size", s.tp_size), ("shard_size", s.shard_size),
                                  ("bucket_cap_mb", s.bucket_cap_mb)) if v is not None})
    if max_grad_norm is not None:
        out.update(max_grad_norm=max_grad_norm, clip_mode=s.clip_mode)
    return out


def _call(s: FitSetting, cls: type, max_grad_norm: float | None, optimizer_kwargs: dict[str, Any]) -> str:
    """How to run ``s``: its layout and model settings in words, then the optimizer's call."""
    steps = [s.describe()]
    if s.param_dtype != "float32":
        steps.append(f"model.to(torch.{s.param_dtype})")
    if s.checkpoint_blocks:
        steps.append(f"torch.utils.checkpoint (use_reentrant=False) around each of the first {s.checkpoint_blocks} "
                     "blocks")
    if s.autocast:
        steps.append(f"the forward and loss under torch.autocast(dtype=torch.{s.autocast})")
    engine = {"accumulation_steps": s.accumulation_steps} if s.accumulation_steps > 1 else {}
    if max_grad_norm is not None:
        engine.update(max_grad_norm=max_grad_norm, clip_mode=s.clip_mode)
    if s.bucket_cap_mb is not None:
        engine["bucket_cap_mb"] = s.bucket_cap_mb
    args = ", ".join(f"{k}={v!r}" for k, v in {**engine, **optimizer_kwargs}.items())
    steps.append(f"dist_optim.InBackwardOptimizer(model, {cls.__module__}.{cls.__qualname__}"
                 + (f", {args})" if args else ")"))
    return "; ".join(steps)

"""``dist_optim.fit``: the settings of a model's training job searched for those that fit a memory budget
(``_fit.fit_settings`` plans and ranks them). This module lists the settings a world allows and says how to build
and run each: the model with some of its blocks checkpointed (``checkpoint_first``), in another dtype, or with fewer
blocks for a shallow trace.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_optim._planner._fit import HEADROOM, fit_settings
from dist_optim._planner._fit_types import ALLOW, FitResult, FitSetting
from dist_optim._planner._fsdp2 import default_units
from dist_optim._planner._guard import FakeCopies
from dist_optim._torch_internals import FakeTensorMode

__all__: list[str] = []


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's blocks: the ``nn.ModuleList`` holding the most parameters (FSDP2's default units)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def checkpoint_first(model: nn.Module, n: int) -> nn.Module:
    """``model`` with the first ``n`` of its blocks (the entries of the ``nn.ModuleList`` holding the most
    parameters) recomputing their forward in backward (``torch.utils.checkpoint``, non-reentrant). Each block's
    ``forward`` is wrapped in place, so that the model's structure (its names, a tensor-parallel plan's paths) stays
    as it was."""
    if n:
        for block in list(_blocks(model))[:n]:
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
        bucket_caps: Sequence[float | None] = (None,), verify: int = 2, **optimizer_kwargs: Any) -> FitResult:
    """The settings of a training job that keep each device under ``memory``, ranked by estimated step time.

    Searched, where the world allows (``devices`` per node, ``nodes``): the layout (one device; DDP, FSDP2; HSDP
    over several nodes; with ``parallelize``, TP within a node and FSDP2 x TP), the micro-batch and accumulation
    that make ``global_batch`` samples per optimizer step, activation checkpointing of none, half or all of the
    model's blocks (the entries of its largest ``nn.ModuleList``), with ``max_grad_norm`` the clip mode
    (``two_pass`` or ``exact``), and ``bucket_caps``. By default only settings bitwise equal to the standard loop of
    the job asked for are candidates; ``allow`` widens that: ``"bf16-params"`` (parameters, gradients and state in
    bfloat16), ``"autocast"`` (the forward under bfloat16 autocast), ``"low-bit-states"`` (torchao's
    ``AdamW8bit``/``AdamW4bit`` for ``AdamW``, where installed), ``"reordered-draws"`` (``random_draws="reordered"``
    in every candidate's call: a class whose step draws random numbers, torchao's ``bf16_stochastic_round=True``,
    then steps in buckets; the memory is the same). Each candidate's peak per device is the larger of
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
    with FakeTensorMode(), FakeCopies():
        model = model_fn()
        n_blocks = len((fsdp_units or default_units)(model))
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    world = devices * nodes
    states = {"full": optimizer_class, **(_low_bit(optimizer_class) if "low-bit-states" in names else {})}
    dtypes = [("float32", None)] + [("bfloat16", None)] * ("bf16-params" in names) + \
        [("float32", "bfloat16")] * ("autocast" in names)
    draws = "reordered" if "reordered-draws" in names else "exact"  # a permission: the same memory either way
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
                                               clip, cap, draws))
    shards = {"none": 1, "ddp": 1, "hsdp": devices}

    def params_bytes(s: FitSetting) -> int:
        return n_params * (2 if s.param_dtype == "bfloat16" else 4) // shards.get(s.parallel, world)

    def plan_for(s: FitSetting, depth: int | None = None) -> dict[str, Any]:
        return _plan_arguments(s, model_fn, batch_fn, loss_fn, states[s.state], parallelize, fsdp_units,
                               max_grad_norm, optimizer_kwargs, depth)
    # the blocks are the largest ModuleList's entries, which a shallow trace keeps the first of
    result = fit_settings(settings, plan_for, memory=memory, params_bytes=params_bytes, headroom=headroom,
                          device=device, verify=verify, blocks=n_blocks if fsdp_units is None else None)
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


def _cast_floating(b: Any, dtype: torch.dtype) -> Any:
    """A batch (a tensor, or tuples, lists and dicts of them) with its floating-point tensors in ``dtype``."""
    if isinstance(b, torch.Tensor):
        return b.to(dtype) if b.is_floating_point() else b
    if isinstance(b, (tuple, list)):
        return type(b)(_cast_floating(x, dtype) for x in b)
    if isinstance(b, dict):
        return {k: _cast_floating(v, dtype) for k, v in b.items()}
    return b


def _plan_arguments(s: FitSetting, model_fn: Callable[[], nn.Module], batch_fn: Callable[[int], Any],
                    loss_fn: Callable[..., torch.Tensor], cls: type, parallelize: Any, fsdp_units: Any,
                    max_grad_norm: float | None, optimizer_kwargs: dict[str, Any], depth: int | None
                    ) -> dict[str, Any]:
    def build() -> nn.Module:
        with _default_dtype(getattr(torch, s.param_dtype)):
            model = model_fn()
        if depth is not None:  # a shallow copy of the model: its first ``depth`` blocks
            del _blocks(model)[depth:]
        return checkpoint_first(model, s.checkpoint_blocks)
    def batch() -> Any:  # parameters in another dtype take their floating-point inputs in it (ids stay ids)
        b = batch_fn(s.micro_batch)
        if s.param_dtype == "float32":
            return b
        return _cast_floating(b, getattr(torch, s.param_dtype))
    out: dict[str, Any] = dict(model_fn=build, batch_fn=batch, loss_fn=loss_fn,
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
    if s.random_draws != "exact":
        out["random_draws"] = s.random_draws
    if max_grad_norm is not None:
        out.update(max_grad_norm=max_grad_norm, clip_mode=s.clip_mode)
    return out


def _call(s: FitSetting, cls: type, max_grad_norm: float | None, optimizer_kwargs: dict[str, Any]) -> str:
    """How to run ``s``: its layout and model settings in words, then the optimizer's call."""
    steps = [s.describe()]
    if s.param_dtype != "float32":
        steps.append(f"model.to(torch.{s.param_dtype}) and the batch's floating-point tensors too")
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
    if s.random_draws != "exact":
        engine["random_draws"] = s.random_draws
    args = ", ".join(f"{k}={v!r}" for k, v in {**engine, **optimizer_kwargs}.items())
    steps.append(f"dist_optim.InBackwardOptimizer(model, {cls.__module__}.{cls.__qualname__}"
                 + (f", {args})" if args else ")"))
    return "; ".join(steps)

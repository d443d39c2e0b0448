"""FSDP2 (``fully_shard``): ``InBackwardOptimizer`` steps the sharded DTensor parameters inside backward, right
after FSDP2's reduce-scatter, and ends bitwise where the same FSDP2 model ends with the standard loop.

Every scenario builds one model, shards two copies of it identically, trains one in backward and the other with
``loss.backward(); opt.step(); opt.zero_grad()`` (same optimizer, same ``fused``/``foreach`` implementation, each
rank on its own data), and compares the full parameters and optimizer state (``full_tensor()``) with
``torch.equal``. Each scenario is its own test, run by the session's group of ranks (tests/dist_runner.py):
``pytest -k "test_fsdp2 and clip/previous_norm"`` runs one.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import (
    ADAGRAD,
    ADAMW,
    SGD_MOMENTUM,
    STEPS,
    WIDTH,
    batches,
    loss_of,
    make_model,
)
from torch import nn

import dist_optim

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

TINY_BUCKETS = 1e-3  # MiB: a few shards per bucket, so buckets complete (and step) in the middle of backward
N_PARAMS = 10  # make_model(width=WIDTH): 3 layers x (weight, bias), LayerNorm (weight, bias), head (weight, bias)

# name, class, options; both sides run the implementation named in the options (torch has fused kernels for
# DTensors only for Adam and AdamW, and no fused RMSprop at all)
OPTIMIZERS = [
    ("AdamW-fused", torch.optim.AdamW, ADAMW),
    ("Adam-fused", torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    ("Adam-foreach", torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    ("SGD-momentum-foreach", torch.optim.SGD, SGD_MOMENTUM),
    ("Adagrad-foreach", torch.optim.Adagrad, ADAGRAD),
    ("RMSprop-foreach", torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "foreach": True}),
]


class DTensorPathAdamW(torch.optim.AdamW):
    """Not in dist_optim.engine._stepper.ELEMENTWISE (a subclass could reduce over a tensor): stepped as DTensors."""


# -- comparison ---------------------------------------------------------------------------------------------------
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layout(v):
    if isinstance(v, DTensor):
        return f"DTensor{tuple(v.placements)}"
    return type(v).__name__


def _snapshot(model: nn.Module, state_dicts: list[dict], drop: tuple[str, ...] = ()) -> dict:
    """Full parameters and optimizer state (param-group keys in ``drop`` left out). Collective (``full_tensor``):
    every rank calls it in the same order."""
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    state, groups = {}, []
    for j, sd in enumerate(state_dicts):
        for k in sorted(sd["state"]):
            for key in sorted(sd["state"][k]):
                v = sd["state"][k][key]
                state[(j, k, key)] = (_layout(v), _full(v) if isinstance(v, torch.Tensor) else v)
        groups.append([{k: v for k, v in g.items() if k not in drop} for g in sd["param_groups"]])
    return {"params": params, "state": state, "groups": groups}


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for name, p in a["params"].items():
        q = b["params"][name]
        if p.dtype != q.dtype or not torch.equal(p, q):
            out.append(f"param {name} differs (max |diff| {(p.double() - q.double()).abs().max().item():.3g})")
    if a["state"].keys() != b["state"].keys():
        out.append(f"state keys differ: {sorted(a['state'].keys() ^ b['state'].keys())}")
    for key in sorted(a["state"].keys() & b["state"].keys()):
        (la, va), (lb, vb) = a["state"][key], b["state"][key]
        if la != lb:
            out.append(f"state{list(key)} layout {la} vs {lb}")
        elif isinstance(va, torch.Tensor):
            if va.dtype != vb.dtype or not torch.equal(va, vb):
                out.append(f"state{list(key)} differs")
        elif va != vb:
            out.append(f"state{list(key)} {va!r} vs {vb!r}")
    if a["groups"] != b["groups"]:
        out.append(f"param_groups differ: {a['groups']} vs {b['groups']}")
    return out


def _assert_same(a_model, a_sds, b_model, b_sds, initial: dict[str, torch.Tensor], drop: tuple[str, ...] = ()) -> None:
    sa, sb = _snapshot(a_model, a_sds, drop), _snapshot(b_model, b_sds, drop)
    problems = _differences(sa, sb)
    if all(torch.equal(sb["params"][n], p) for n, p in initial.items()):
        problems.append("the reference never changed the parameters: the comparison would prove nothing")
    assert not problems, "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else "")


# -- building and training ----------------------------------------------------------------------------------------
def _twins(mesh, *, nested: bool = True, **fsdp_kwargs):
    """One model, two identically sharded copies, and its initial parameters."""
    base = make_model(width=WIDTH)
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    for m in (a, b):
        if nested:
            for layer in m.layers:
                fully_shard(layer, mesh=mesh, **fsdp_kwargs)
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
    placements = tuple(type(x).__name__ for x in a.head.weight.placements)
    want = ("Replicate", "Shard") if mesh.ndim == 2 else ("Shard",)  # HSDP: replicated across, sharded within
    assert placements == want, f"sharded as {placements}, expected {want}"
    return a, b, initial


def _data(rank: int, steps: int = STEPS, micro: int = 1):
    flat = batches(steps * micro, width=WIDTH, seed=10 + rank)  # each rank its own data: the reduction matters
    return [flat[s * micro : (s + 1) * micro] for s in range(steps)]


def _micro_loss(model, batch, micro: int) -> torch.Tensor:
    loss = loss_of(model, batch)
    return loss / micro if micro > 1 else loss


def _check_stepped_in_backward(model, opt) -> None:
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not left, f"gradients left after an in-backward step: {left}"
    stepped = opt.last_step.params_stepped
    assert stepped == N_PARAMS, f"{stepped} of {N_PARAMS} parameters stepped in backward"


def _train_in_backward(model, opt, data, *, accumulate: str = "", standard_calls: bool = False) -> None:
    """``accumulate``: ``"sync"`` (set_requires_gradient_sync(False) before the non-final micro-batches) or
    ``"no_step"`` (opt.no_step() around them: FSDP2 still reduces and accumulates the sharded gradients)."""
    for step in data:
        micro = len(step)
        for j, batch in enumerate(step):
            last = j == micro - 1
            if accumulate == "sync":
                model.set_requires_gradient_sync(last)
            if accumulate == "no_step" and not last:
                with opt.no_step():
                    opt.backward(_micro_loss(model, batch, micro))
            else:
                opt.backward(_micro_loss(model, batch, micro))  # loss.backward(), but with clip_mode="two_pass"
        _check_stepped_in_backward(model, opt)
        if standard_calls:  # an unchanged standard loop: both calls must be harmless no-ops
            opt.step()
            opt.zero_grad()


def _train_standard(model, opt, data, *, accumulate: str = "", before_step: Callable | None = None) -> None:
    for step in data:
        micro = len(step)
        for j, batch in enumerate(step):
            if accumulate == "sync":
                model.set_requires_gradient_sync(j == micro - 1)
            _micro_loss(model, batch, micro).backward()  # "no_step" counterpart: reduce every micro-batch
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()


def _parity(
    ctx,
    cls,
    kwargs,
    *,
    nested: bool = True,
    fsdp: dict | None = None,
    ib: dict | None = None,
    ref_kwargs: dict | None = None,
    micro: int = 1,
    accumulate: str = "",
    standard_calls: bool = False,
) -> None:
    """The in-backward optimizer on one FSDP2 copy, the standard loop on the other, same data: bitwise equal."""
    a, b, initial = _twins(ctx["mesh"], nested=nested, **(fsdp or {}))
    opt = dist_optim.InBackwardOptimizer(a, cls, **{"bucket_cap_mb": TINY_BUCKETS, **(ib or {})}, **kwargs)
    ref = cls(b.named_parameters(), **(kwargs if ref_kwargs is None else ref_kwargs))
    data = _data(ctx["rank"], micro=micro)
    _train_in_backward(a, opt, data, accumulate=accumulate, standard_calls=standard_calls)
    _train_standard(b, ref, data, accumulate=accumulate)
    # a group keeps the user's fused/foreach=None when the engine chose the implementation itself
    drop = ("fused", "foreach") if ref_kwargs is not None else ()
    _assert_same(a, [opt.state_dict()], b, [ref.state_dict()], initial, drop)


# -- clipping and the gradient norm -------------------------------------------------------------------------------
def _norm_parity(ctx, *, ib: dict, reference: Callable, micro: int = 1, accumulate: str = "") -> None:
    """``reference(params, previous_norm)`` clips the standard side's gradients and returns the norm
    ``clip_grad_norm_`` reports (or ``None``); the in-backward side's ``grad_norm`` must equal it each step."""
    a, b, initial = _twins(ctx["mesh"])
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ib, **ADAMW)
    ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
    data = _data(ctx["rank"], micro=micro)
    norms: list = []
    for k, step in enumerate(data):
        _train_in_backward(a, opt, [step], accumulate=accumulate)
        ref_norm = None

        def clip():
            nonlocal ref_norm
            ref_norm = reference(list(b.parameters()), norms[-1] if norms else None)

        _train_standard(b, ref, [step], before_step=clip, accumulate=accumulate)
        if ref_norm is not None:
            got = opt.grad_norm
            assert isinstance(got, DTensor), f"grad_norm is a {type(got).__name__}, not a DTensor"
            got, want = got.full_tensor(), ref_norm.full_tensor()
            assert torch.equal(got, want), f"step {k}: grad_norm {got.item()!r} vs clip_grad_norm_ {want.item()!r}"
            norms.append(ref_norm)
    _assert_same(a, [opt.state_dict()], b, [ref.state_dict()], initial)


def _clip_exact(params, _previous):
    norm = nn.utils.clip_grad_norm_(params, 0.05)
    assert norm.full_tensor() > 0.05, "the clipping threshold is never reached: choose a smaller one"
    return norm


def _track_only(params, _previous):
    return nn.utils.get_total_norm([p.grad for p in params])


def _clip_per_parameter(params, _previous):
    for p in params:
        nn.utils.clip_grad_norm_([p], 0.05)
    return None


def _clip_previous_norm(params, previous):
    norm = nn.utils.get_total_norm([p.grad for p in params])
    if previous is not None:
        coef = torch.clamp(0.05 / (previous + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
    return norm


def _clip_value(params, _previous):
    nn.utils.clip_grad_value_(params, 0.01)
    return None


# -- state dict ---------------------------------------------------------------------------------------------------
def _round_trip(ctx, *, source: str, target: str) -> None:
    """Train 2 steps, save ``source``'s state dict (through bytes, as a checkpoint would), load it into a new
    ``target`` optimizer (``"in-backward"`` or ``"standard"``), train on: equal to the uninterrupted standard loop."""
    a, b, initial = _twins(ctx["mesh"])
    data = _data(ctx["rank"], steps=4)
    ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
    first = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ADAMW)
    _train_in_backward(a, first, data[:2])
    _train_standard(b, ref, data[:2])
    buffer = io.BytesIO()
    torch.save((ref if source == "standard" else first).state_dict(), buffer)
    first.remove()
    del first
    buffer.seek(0)
    if target == "in-backward":
        second = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ADAMW)
    else:
        second = torch.optim.AdamW(a.named_parameters(), **ADAMW)
    second.load_state_dict(torch.load(buffer))
    if target == "in-backward":
        _train_in_backward(a, second, data[2:])
    else:
        _train_standard(a, second, data[2:])
    _train_standard(b, ref, data[2:])
    _assert_same(a, [second.state_dict()], b, [ref.state_dict()], initial)


# -- buckets and fully_shard units --------------------------------------------------------------------------------
def _buckets_within_units(ctx, *, ib: dict, fsdp: dict | None = None) -> None:
    """A unit's sharded gradients are views of its reduce-scatter output, alive while any of them is: no bucket
    spans two units, so when any gradient arrives no other unit's gradient is alive (in the first backward, which
    learns the buckets, too); with a cap every unit fits in, one bucket per unit. Equal to the standard loop."""
    a, b, initial = _twins(ctx["mesh"], **(fsdp or {}))
    units = [[f"layers.{k}.{n}" for n, _ in layer.named_parameters()] for k, layer in enumerate(a.layers)]
    units.append([n for n, _ in a.named_parameters() if not n.startswith("layers.")])
    unit_of = {n: k for k, names in enumerate(units) for n in names}
    # the sharded parameters: during backward the module holds a unit's unsharded ones, whose gradients are FSDP2's
    sharded = dict(a.named_parameters())
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ib, **ADAMW)
    overlaps: list[str] = []

    def probe(name: str) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:  # registered after the optimizer's hook: runs once it has settled
            alive = [n for n, q in sharded.items() if q.grad is not None and unit_of[n] != unit_of[name]]
            if alive:
                overlaps.append(f"{name} arrived while {alive} were alive")

        return hook

    for n, p in sharded.items():
        p.register_post_accumulate_grad_hook(probe(n))
    ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
    data = _data(ctx["rank"])
    _train_in_backward(a, opt, data)
    _train_standard(b, ref, data)
    assert not overlaps, overlaps[:3]
    name_of = {id(p): n for n, p in sharded.items()}
    spans = [sorted({unit_of[name_of[id(p)]] for p in bucket}) for bucket in opt.buckets]
    assert all(len(s) == 1 for s in spans), f"buckets span units: {spans}"
    if ib.get("bucket_cap_mb", dist_optim.optimizer.DEFAULT_BUCKET_CAP_MB) >= 1:
        assert len(opt.buckets) == len(units), f"{len(opt.buckets)} buckets for {len(units)} units: {spans}"
    _assert_same(a, [opt.state_dict()], b, [ref.state_dict()], initial)


# -- the seed API -------------------------------------------------------------------------------------------------
def _seed_api(ctx, cls, kwargs) -> None:
    a, b, initial = _twins(ctx["mesh"])
    dist_optim.apply_optimizer_in_backward(cls, a.parameters(), kwargs)
    ref = cls(b.parameters(), **kwargs)
    for step in _data(ctx["rank"]):
        loss_of(a, step[0]).backward()
        left = [n for n, p in a.named_parameters() if p.grad is not None]
        assert not left, f"gradients left after backward: {left}"
        _train_standard(b, ref, [step])
    per_param = dist_optim.get_in_backward_optimizers(a)
    assert len(per_param) == N_PARAMS
    # one state dict per parameter on the seed side, one for all on the standard side: compare entry by entry
    ref_sd = ref.state_dict()
    ref_sds = [{"state": {0: ref_sd["state"][k]}, "param_groups": []} for k in range(N_PARAMS)]
    seed_sds = [{"state": o.state_dict()["state"], "param_groups": []} for o in per_param]
    _assert_same(a, seed_sds, b, ref_sds, initial)


# -- refusals -----------------------------------------------------------------------------------------------------
def _refuse_accumulation_steps(ctx) -> None:
    a, _, _ = _twins(ctx["mesh"])
    with pytest.raises(NotImplementedError, match=r"accumulation_steps > 1.*set_requires_gradient_sync"):
        dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, accumulation_steps=2)
    # nothing stayed attached: the same model is accepted afterwards
    dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW).remove()


def _refuse_plain_model(ctx) -> None:
    with pytest.raises(RuntimeError, match=r"2 ranks is initialised.*fully_shard.*allow_local_steps=True"):
        dist_optim.InBackwardOptimizer(make_model(width=WIDTH), torch.optim.AdamW)


def _refuse_partly_sharded(ctx) -> None:
    partly = make_model(width=WIDTH)
    for layer in partly.layers:  # the root (norm, head) left unsharded: its gradients are never reduced
        fully_shard(layer, mesh=ctx["mesh"])
    with pytest.raises(RuntimeError, match=r"2 ranks is initialised.*fully_shard.*allow_local_steps=True"):
        dist_optim.InBackwardOptimizer(partly, torch.optim.AdamW)


def _refuse_fsdp1(ctx) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(make_model(width=WIDTH), device_id=torch.device("cpu"), use_orig_params=True)
    # the refusal names the two ways that work: fully_shard, and the seed pair on FSDP1's original parameters
    with pytest.raises(NotImplementedError, match=r"FSDP1.*fsdp\.fully_shard.*use_orig_params=True.*"
                                                  r"apply_optimizer_in_backward"):
        dist_optim.InBackwardOptimizer(fsdp1, torch.optim.AdamW)


# -- the scenarios, per world size --------------------------------------------------------------------------------
def _two_rank_scenarios() -> list[tuple[str, Callable, dict]]:
    s: list[tuple[str, Callable, dict]] = []
    for name, cls, kw in OPTIMIZERS:
        s.append((f"{name}/root-only", _parity, dict(cls=cls, kwargs=kw, nested=False)))
        s.append((f"{name}/nested", _parity, dict(cls=cls, kwargs=kw)))
    # a class outside dist_optim's elementwise list is stepped as DTensors, not on the local shards
    s.append(("AdamW-subclass/stepped-as-DTensors", _parity, dict(cls=DTensorPathAdamW, kwargs=ADAMW)))
    # DTensor has no fused Adagrad kernel: the default implementation is probed on a DTensor and falls back
    s.append(("Adagrad/default-implementation-foreach", _parity,
              dict(cls=torch.optim.Adagrad, kwargs={"lr": 0.1}, ref_kwargs={"lr": 0.1, "foreach": True})))
    # the in-backward default implementation (no flag given) is the fused/foreach one named on the reference
    for name, cls, kw, impl in [
        ("AdamW", torch.optim.AdamW, {"lr": 1e-2}, "fused"),
        ("Adam", torch.optim.Adam, {"lr": 1e-2}, "fused"),
        ("SGD-momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "foreach"),
        ("RMSprop", torch.optim.RMSprop, {"lr": 1e-2}, "foreach"),
    ]:
        s.append((f"{name}/default-implementation-{impl}", _parity,
                  dict(cls=cls, kwargs=kw, ref_kwargs={**kw, impl: True})))
    adamw = dict(cls=torch.optim.AdamW, kwargs=ADAMW)
    sgd = dict(cls=torch.optim.SGD, kwargs=SGD_MOMENTUM)
    s.append(("AdamW/cap-4MiB-one-bucket-per-unit", _parity, dict(adamw, ib={"bucket_cap_mb": 4})))
    s.append(("buckets/one-per-unit-default-cap", _buckets_within_units, dict(ib={})))
    s.append(("buckets/within-units-tiny-cap", _buckets_within_units, dict(ib={"bucket_cap_mb": TINY_BUCKETS})))
    s.append(("buckets/one-per-unit-mixed-precision-bf16", _buckets_within_units,
              dict(ib={}, fsdp={"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32)})))
    s.append(("AdamW/per_parameter", _parity, dict(adamw, ib={"per_parameter": True})))
    s.append(("AdamW/unchanged-standard-loop", _parity, dict(adamw, standard_calls=True)))
    no_reshard = {"reshard_after_forward": False}
    s.append(("AdamW/reshard_after_forward-False", _parity, dict(adamw, fsdp=no_reshard)))
    s.append(("SGD/reshard_after_forward-False/root-only", _parity, dict(sgd, nested=False, fsdp=no_reshard)))
    bf16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    s.append(("AdamW/mixed-precision-bf16", _parity, dict(adamw, fsdp=bf16)))
    s.append(("Adagrad/mixed-precision-bf16/root-only", _parity,
              dict(cls=torch.optim.Adagrad, kwargs=ADAGRAD, nested=False, fsdp=bf16)))
    s.append(("AdamW/accumulate-set_requires_gradient_sync", _parity, dict(adamw, micro=3, accumulate="sync")))
    s.append(("SGD/accumulate-set_requires_gradient_sync/root-only", _parity,
              dict(sgd, nested=False, micro=2, accumulate="sync")))
    s.append(("AdamW/accumulate-no_step", _parity, dict(adamw, micro=3, accumulate="no_step")))
    s.append(("AdamW/accumulate-no_step/mixed-precision-bf16", _parity,
              dict(adamw, fsdp=bf16, micro=2, accumulate="no_step")))
    s.append(("clip/max_grad_norm-exact", _norm_parity, dict(ib={"max_grad_norm": 0.05}, reference=_clip_exact)))
    s.append(("clip/track_grad_norm", _norm_parity, dict(ib={"track_grad_norm": True}, reference=_track_only)))
    s.append(("clip/per_parameter", _norm_parity,
              dict(ib={"max_grad_norm": 0.05, "clip_mode": "per_parameter"}, reference=_clip_per_parameter)))
    s.append(("clip/previous_norm", _norm_parity,
              dict(ib={"max_grad_norm": 0.05, "clip_mode": "previous_norm"}, reference=_clip_previous_norm)))
    s.append(("clip/max_grad_value", _norm_parity, dict(ib={"max_grad_value": 0.01}, reference=_clip_value)))
    two_pass = {"max_grad_norm": 0.05, "clip_mode": "two_pass"}
    s.append(("clip/two_pass", _norm_parity, dict(ib=two_pass, reference=_clip_exact)))
    s.append(("clip/two_pass/per_parameter", _norm_parity, dict(ib={**two_pass, "per_parameter": True},
                                                               reference=_clip_exact)))
    for accumulate in ("sync", "no_step"):
        s.append((f"clip/two_pass/accumulate-{accumulate}", _norm_parity,
                  dict(ib=two_pass, reference=_clip_exact, micro=2, accumulate=accumulate)))
    for source, target in [("in-backward", "in-backward"), ("standard", "in-backward"), ("in-backward", "standard")]:
        s.append((f"state_dict/{source}-to-{target}", _round_trip, dict(source=source, target=target)))
    s.append(("seed-api/SGD-momentum-foreach", _seed_api, dict(sgd)))
    s.append(("seed-api/AdamW-fused", _seed_api, dict(adamw)))
    s.append(("refused/accumulation_steps-2", _refuse_accumulation_steps, {}))
    s.append(("refused/plain-model", _refuse_plain_model, {}))
    s.append(("refused/root-not-sharded", _refuse_partly_sharded, {}))
    s.append(("refused/FSDP1", _refuse_fsdp1, {}))
    return s


def _four_rank_scenarios() -> list[tuple[str, Callable, dict]]:
    adamw = dict(cls=torch.optim.AdamW, kwargs=ADAMW)
    return [
        ("HSDP/AdamW-fused/nested", _parity, adamw),
        ("HSDP/SGD-momentum-foreach/root-only", _parity,
         dict(cls=torch.optim.SGD, kwargs=SGD_MOMENTUM, nested=False)),
        ("HSDP/AdamW/accumulate-set_requires_gradient_sync", _parity, dict(adamw, micro=2, accumulate="sync")),
        ("HSDP/AdamW/accumulate-no_step", _parity, dict(adamw, micro=2, accumulate="no_step")),
        ("HSDP/clip/max_grad_norm-exact", _norm_parity, dict(ib={"max_grad_norm": 0.05}, reference=_clip_exact)),
        ("HSDP/clip/two_pass", _norm_parity, dict(ib={"max_grad_norm": 0.05, "clip_mode": "two_pass"},
                                                 reference=_clip_exact)),
    ]


def _on_mesh(ctx, scenario: Callable, **kwargs) -> None:
    """Runs on each rank: the scenario gets its rank and the mesh of its world size (HSDP on 4 ranks)."""
    if ctx.world == 4:
        mesh = ctx.cached("hsdp-mesh", lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    else:
        mesh = ctx.cached("fsdp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))
    scenario({"rank": ctx.rank, "world": ctx.world, "mesh": mesh}, **kwargs)


SCENARIOS = [
    pytest.param(world, fn, kwargs, id=f"{world}ranks/{name}")
    for world, table in ((2, _two_rank_scenarios), (4, _four_rank_scenarios)) if dist.is_available()
    for name, fn, kwargs in table()
]


@pytest.mark.parametrize("world, scenario, kwargs", SCENARIOS)
def test_fsdp2_equals_the_standard_loop(ranks, world, scenario, kwargs):
    ranks.run(world, _on_mesh, scenario=scenario, **kwargs)

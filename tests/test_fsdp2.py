"""FSDP2 (``fully_shard``): ``InBackwardOptimizer`` steps the sharded DTensor parameters inside backward, right
after FSDP2's reduce-scatter, and ends bitwise where the same FSDP2 model ends with the standard loop.

Every scenario builds one model, shards two copies of it identically, trains one in backward and the other with
``loss.backward(); opt.step(); opt.zero_grad()`` (same optimizer, same ``fused``/``foreach`` implementation, each
rank on its own data), and compares the full parameters and optimizer state (``full_tensor()``) with
``torch.equal``. Starting a process group is the slow part, so each world size runs all its scenarios in one
spawned gloo group (FileStore in ``tmp_path``, so parallel test workers never collide); every scenario's outcome
is collected, and a failure names each scenario that failed with its reason.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import os
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dist_optim
from helpers import batches, loss_of, make_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

WIDTH = 16
STEPS = 3
TINY_BUCKETS = 1e-3  # MiB: a few shards per bucket, so buckets complete (and step) in the middle of backward
N_PARAMS = 10  # make_model(width=WIDTH): 3 layers x (weight, bias), LayerNorm (weight, bias), head (weight, bias)

# name, class, options; both sides run the implementation named in the options (torch has fused kernels for
# DTensors only for Adam and AdamW, and no fused RMSprop at all)
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
SGD_MOMENTUM = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "foreach": True}
ADAGRAD = {"lr": 0.1, "foreach": True}
OPTIMIZERS = [
    ("AdamW-fused", torch.optim.AdamW, ADAMW),
    ("Adam-fused", torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    ("Adam-foreach", torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    ("SGD-momentum-foreach", torch.optim.SGD, SGD_MOMENTUM),
    ("Adagrad-foreach", torch.optim.Adagrad, ADAGRAD),
    ("RMSprop-foreach", torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "foreach": True}),
]


class DTensorPathAdamW(torch.optim.AdamW):
    """Not in dist_optim._shards.ELEMENTWISE (a subclass could reduce over a tensor): stepped as DTensors."""


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
                    _micro_loss(model, batch, micro).backward()
            else:
                _micro_loss(model, batch, micro).backward()
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
def _norm_parity(ctx, *, ib: dict, reference: Callable) -> None:
    """``reference(params, previous_norm)`` clips the standard side's gradients and returns the norm
    ``clip_grad_norm_`` reports (or ``None``); the in-backward side's ``grad_norm`` must equal it each step."""
    a, b, initial = _twins(ctx["mesh"])
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ib, **ADAMW)
    ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
    data = _data(ctx["rank"])
    norms: list = []
    for k, step in enumerate(data):
        _train_in_backward(a, opt, [step])
        ref_norm = None

        def clip():
            nonlocal ref_norm
            ref_norm = reference(list(b.parameters()), norms[-1] if norms else None)

        _train_standard(b, ref, [step], before_step=clip)
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
    with pytest.raises(NotImplementedError, match=r"FSDP1.*torch\.distributed\.fsdp\.fully_shard"):
        dist_optim.InBackwardOptimizer(fsdp1, torch.optim.AdamW)


# -- the scenarios, per world size --------------------------------------------------------------------------------
def _two_rank_scenarios() -> dict[str, Callable]:
    s: dict[str, Callable] = {}
    for name, cls, kw in OPTIMIZERS:
        s[f"{name}/root-only"] = lambda c, cls=cls, kw=kw: _parity(c, cls, kw, nested=False)
        s[f"{name}/nested"] = lambda c, cls=cls, kw=kw: _parity(c, cls, kw)
    # a class outside dist_optim's elementwise list is stepped as DTensors, not on the local shards
    s["AdamW-subclass/stepped-as-DTensors"] = lambda c: _parity(c, DTensorPathAdamW, ADAMW)
    # DTensor has no fused Adagrad kernel: the default implementation is probed on a DTensor and falls back
    s["Adagrad/default-implementation=foreach"] = lambda c: _parity(
        c, torch.optim.Adagrad, {"lr": 0.1}, ref_kwargs={"lr": 0.1, "foreach": True}
    )
    # the in-backward default implementation (no flag given) is the fused/foreach one named on the reference
    for name, cls, kw, impl in [
        ("AdamW", torch.optim.AdamW, {"lr": 1e-2}, "fused"),
        ("Adam", torch.optim.Adam, {"lr": 1e-2}, "fused"),
        ("SGD-momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "foreach"),
        ("RMSprop", torch.optim.RMSprop, {"lr": 1e-2}, "foreach"),
    ]:
        s[f"{name}/default-implementation={impl}"] = lambda c, cls=cls, kw=kw, impl=impl: _parity(
            c, cls, kw, ref_kwargs={**kw, impl: True}
        )
    s["AdamW/one-bucket(default-cap)"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, ib={"bucket_cap_mb": 4})
    s["AdamW/per_parameter"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, ib={"per_parameter": True})
    s["AdamW/unchanged-standard-loop"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, standard_calls=True)
    no_reshard = {"reshard_after_forward": False}
    s["AdamW/reshard_after_forward=False"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, fsdp=no_reshard)
    s["SGD/reshard_after_forward=False/root-only"] = lambda c: _parity(
        c, torch.optim.SGD, SGD_MOMENTUM, nested=False, fsdp=no_reshard
    )
    bf16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    s["AdamW/mixed-precision-bf16"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, fsdp=bf16)
    s["Adagrad/mixed-precision-bf16/root-only"] = lambda c: _parity(
        c, torch.optim.Adagrad, ADAGRAD, nested=False, fsdp=bf16
    )
    s["AdamW/accumulate-set_requires_gradient_sync"] = lambda c: _parity(
        c, torch.optim.AdamW, ADAMW, micro=3, accumulate="sync"
    )
    s["SGD/accumulate-set_requires_gradient_sync/root-only"] = lambda c: _parity(
        c, torch.optim.SGD, SGD_MOMENTUM, nested=False, micro=2, accumulate="sync"
    )
    s["AdamW/accumulate-no_step"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, micro=3, accumulate="no_step")
    s["AdamW/accumulate-no_step/mixed-precision-bf16"] = lambda c: _parity(
        c, torch.optim.AdamW, ADAMW, fsdp=bf16, micro=2, accumulate="no_step"
    )
    s["clip/max_grad_norm-exact"] = lambda c: _norm_parity(c, ib={"max_grad_norm": 0.05}, reference=_clip_exact)
    s["clip/track_grad_norm"] = lambda c: _norm_parity(c, ib={"track_grad_norm": True}, reference=_track_only)
    s["clip/per_parameter"] = lambda c: _norm_parity(
        c, ib={"max_grad_norm": 0.05, "clip_mode": "per_parameter"}, reference=_clip_per_parameter
    )
    s["clip/previous_norm"] = lambda c: _norm_parity(
        c, ib={"max_grad_norm": 0.05, "clip_mode": "previous_norm"}, reference=_clip_previous_norm
    )
    s["clip/max_grad_value"] = lambda c: _norm_parity(c, ib={"max_grad_value": 0.01}, reference=_clip_value)
    for source, target in [("in-backward", "in-backward"), ("standard", "in-backward"), ("in-backward", "standard")]:
        s[f"state_dict/{source}->{target}"] = lambda c, source=source, target=target: _round_trip(
            c, source=source, target=target
        )
    s["seed-api/SGD-momentum-foreach"] = lambda c: _seed_api(c, torch.optim.SGD, SGD_MOMENTUM)
    s["seed-api/AdamW-fused"] = lambda c: _seed_api(c, torch.optim.AdamW, ADAMW)
    s["refused/accumulation_steps=2"] = _refuse_accumulation_steps
    s["refused/plain-model"] = _refuse_plain_model
    s["refused/root-not-sharded"] = _refuse_partly_sharded
    s["refused/FSDP1"] = _refuse_fsdp1
    return s


def _four_rank_scenarios() -> dict[str, Callable]:
    s: dict[str, Callable] = {}
    s["HSDP/AdamW-fused/nested"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW)
    s["HSDP/SGD-momentum-foreach/root-only"] = lambda c: _parity(c, torch.optim.SGD, SGD_MOMENTUM, nested=False)
    s["HSDP/AdamW/accumulate-set_requires_gradient_sync"] = lambda c: _parity(
        c, torch.optim.AdamW, ADAMW, micro=2, accumulate="sync"
    )
    s["HSDP/AdamW/accumulate-no_step"] = lambda c: _parity(c, torch.optim.AdamW, ADAMW, micro=2, accumulate="no_step")
    s["HSDP/clip/max_grad_norm-exact"] = lambda c: _norm_parity(c, ib={"max_grad_norm": 0.05}, reference=_clip_exact)
    return s


# suite -> (world size, scenarios)
SUITES = {
    "fsdp2": (2, _two_rank_scenarios),
    "hsdp": (4, _four_rank_scenarios),
}


def _worker(rank: int, suite: str, store_path: str, out_dir: str) -> None:
    world, scenarios = SUITES[suite]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a rank stuck in a collective fails instead of hanging
    )
    results: dict[str, str | None] = {}
    try:
        if world == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # HSDP
        else:
            mesh = init_device_mesh("cpu", (world,))
        ctx = {"rank": rank, "world": world, "mesh": mesh}
        for name, scenario in scenarios().items():
            try:
                scenario(ctx)
                results[name] = None
            except (Exception, pytest.fail.Exception) as e:  # pytest.raises' "DID NOT RAISE" is no Exception
                results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _run(suite: str, tmp_path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world, scenarios = SUITES[suite]
    mp.spawn(_worker, args=(suite, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    expected = list(scenarios())
    failures: dict[str, list[str]] = {}
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            results = json.load(f)
        for name in expected:
            error = results.get(name, "did not run")
            if error is not None:
                failures.setdefault(name, []).append(f"[rank {rank}] {error}")
    assert not failures, f"{len(failures)} of {len(expected)} FSDP2 scenarios failed on {world} ranks: " + ", ".join(
        failures
    ) + "\n\n" + "\n".join(f"== {name}\n" + "\n".join(errors) for name, errors in failures.items())


def test_fsdp2_two_ranks_equals_the_standard_loop(tmp_path):
    _run("fsdp2", tmp_path)


def test_hsdp_four_ranks_equals_the_standard_loop(tmp_path):
    _run("hsdp", tmp_path)

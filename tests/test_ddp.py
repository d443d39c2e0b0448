"""DDP: the step runs from a communication hook, after each bucket's all-reduce, on the averaged gradient.

Every scenario compares InBackwardOptimizer on a DDP model with the same DDP wrapping and the standard loop
(``loss.backward(); opt.step(); opt.zero_grad()``), bitwise, on 2 (some on 3 or 4) real gloo ranks that feed different
data. Each scenario is its own test, run by the session's group of ranks (tests/dist_runner.py):
``pytest -k "test_ddp and 2ranks/exact_clipping"`` runs one.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from helpers import ADAMW, STEPS, WIDTH, WORLD_SIZES, batches, loss_of, make_model, train_in_backward
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_optim

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

OPTIMIZERS = {
    "AdamW-fused": (torch.optim.AdamW, ADAMW),
    "Adam-foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "Adagrad-fused": (torch.optim.Adagrad, dict(lr=0.1, fused=True)),
    "RMSprop-foreach": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, foreach=True)),
}


def _pair(ddp_kwargs, ignore=()):
    base = make_model(width=WIDTH)
    wrapped = []
    for _ in range(2):
        module = copy.deepcopy(base)
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
        wrapped.append(DDP(module, **ddp_kwargs))
    return wrapped


def _check_equal(a, b, opt, ref_opt):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item()}"
        assert p.grad is None, f"{name}.grad left after backward"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, state in ref_sd["state"].items():
        for key, v in state.items():
            assert torch.equal(sd["state"][k][key], v), f"state[{k}][{key}]"


def _backward(loss, opt=None):
    """``opt.backward(loss)`` (the in-backward side with ``clip_mode="two_pass"``), else ``loss.backward()``."""
    if opt is not None:
        opt.backward(loss)
    else:
        loss.backward()


def _train(a, b, opt, ref_opt, rank, steps=STEPS, micro=1, clip=None, two_pass=False):
    data = batches(steps * micro, width=WIDTH, seed=10 + rank)
    norms = []
    for s in range(steps):
        for m in range(micro):
            batch = data[s * micro + m]
            last = m == micro - 1
            for model in (a, b):
                if last:
                    _backward(loss_of(model, batch) / micro, opt if two_pass and model is a else None)
                else:
                    with model.no_sync():
                        _backward(loss_of(model, batch) / micro, opt if two_pass and model is a else None)
        if clip is not None:
            norms.append(torch.equal(opt.grad_norm, nn.utils.clip_grad_norm_(b.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(norms), f"grad norms equal per step: {norms}"  # after the loop: a rank leaving early would hang
    moved = make_model(width=WIDTH)
    assert any(not torch.equal(p, q) for p, q in zip(a.module.parameters(), moved.parameters()))


class Branchy(nn.Module):
    """Parameters used unevenly: ``never`` on no rank, ``rank0`` on rank 0 only, ``odd`` on odd steps only (so
    unused everywhere at step 0 and again at step 2, after it has optimizer state), ``alternate`` by one rank per
    step. ``static=True`` keeps only the usage that does not change with the step (for ``static_graph``)."""

    def __init__(self, static: bool = False, width: int = WIDTH) -> None:
        super().__init__()
        self.static = static
        self.trunk = nn.Linear(width, width)
        self.never = nn.Linear(width, width)
        self.rank0 = nn.Linear(width, width)
        self.odd = nn.Linear(width, width)
        self.alternate = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = torch.tanh(self.trunk(x))
        if dist.get_rank() == 0:
            x = torch.tanh(self.rank0(x))
        if not self.static and step % 2 == 1:
            x = torch.tanh(self.odd(x))
        if not self.static and (step + dist.get_rank()) % 2 == 0:
            x = torch.tanh(self.alternate(x))
        return self.head(x)


def _unused_pair(static=False, **ddp_kwargs):
    torch.manual_seed(0)
    base = Branchy(static)
    return [DDP(copy.deepcopy(base), bucket_cap_mb=0.002, **ddp_kwargs) for _ in range(2)]


def _train_unused(a, b, opt, ref_opt, rank, steps=4, micro=1, clip=None, two_pass=False):
    never = a.module.never.weight.detach().clone()
    data = batches(steps * micro, width=WIDTH, seed=10 + rank)
    norms = []
    for s in range(steps):
        for m in range(micro):
            x, y = data[s * micro + m]
            for model in (a, b):
                context = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with context:
                    # micro-batches step on s * micro + m: a parameter used in an earlier one only is still used
                    _backward(nn.functional.mse_loss(model(x, s * micro + m), y) / micro,
                              opt if two_pass and model is a else None)
        if clip is not None:
            norms.append(torch.equal(opt.grad_norm, nn.utils.clip_grad_norm_(b.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(norms), f"grad norms equal per step: {norms}"
    assert torch.equal(a.module.never.weight, never)  # the scenario has a parameter unused everywhere


def _parity(ctx, optimizer="AdamW-fused", ddp=None, ignore=(), compress=False, ib=None, unused=False,
            static=False, steps=None, micro=1, clip=None, two_pass=False):
    """InBackwardOptimizer on one DDP copy, the standard loop on the other (same wrapping, same data per rank):
    parameters and optimizer state bitwise equal. ``unused``: the Branchy model (``static`` usage only)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    if unused:
        a, b = _unused_pair(static, **(ddp or {}))
    else:
        a, b = _pair(ddp if ddp is not None else dict(bucket_cap_mb=0.002), ignore)
    extra = dict(ib or {})
    if compress:  # the hook's result is a new tensor, copied into DDP's bucket before the step
        b.register_comm_hook(None, fp16_compress_hook)
        extra["ddp_comm_hook"] = fp16_compress_hook
    if clip is not None:
        extra["max_grad_norm"] = clip
    if two_pass:
        extra["clip_mode"] = "two_pass"
    opt = dist_optim.InBackwardOptimizer(a, cls, **extra, **kwargs)
    ref_opt = cls(b.named_parameters(), **kwargs)
    train = _train_unused if unused else _train
    train(a, b, opt, ref_opt, ctx.rank, steps=steps or (4 if unused or static else STEPS), micro=micro, clip=clip,
          two_pass=two_pass)
    _check_equal(a, b, opt, ref_opt)
    if ignore:  # DDP does not reduce them: both loops step them on the local gradient
        heads = [torch.empty_like(a.module.head.weight) for _ in range(ctx.world)]
        dist.all_gather(heads, a.module.head.weight.detach())
        assert not torch.equal(heads[0], heads[1])  # local steps, as DDP's standard loop does


def _refusals(ctx):
    cls, kwargs = OPTIMIZERS["AdamW-fused"]
    a, _ = _pair({})
    with pytest.raises(NotImplementedError, match="accumulation_steps > 1 with DDP.*no_sync"):
        dist_optim.InBackwardOptimizer(a, cls, accumulation_steps=2, **kwargs)
    with pytest.raises(RuntimeError, match="Pass the DDP-wrapped model itself"):
        dist_optim.InBackwardOptimizer(a.parameters(), cls, **kwargs)
    seeded = make_model()  # the seed function, never wrapped: refused at its first backward, before it steps
    dist_optim.apply_optimizer_in_backward(cls, seeded.parameters(), {"lr": 0.1})
    with pytest.raises(RuntimeError, match="un-reduced gradient.*nothing was stepped"):
        train_in_backward(seeded, batches(1))
    opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
    with pytest.raises(RuntimeError, match="accumulate with `with model.no_sync\\(\\):`"):
        with opt.no_step():
            loss_of(a, batches(1, width=WIDTH)[0]).backward()
    with pytest.raises(NotImplementedError, match="cannot detach from a DistributedDataParallel model"):
        opt.remove()
    static = DDP(make_model(width=WIDTH), static_graph=True)
    opt = dist_optim.InBackwardOptimizer(static, cls, max_grad_norm=1.0, clip_mode="two_pass", **kwargs)
    with pytest.raises(NotImplementedError, match=r"two_pass' with DDP\(static_graph=True\)"):
        opt.backward(loss_of(static, batches(1, width=WIDTH)[0]))


def _scenarios():
    """(id, function, kwargs, world sizes) of every scenario."""
    both = WORLD_SIZES
    for name in OPTIMIZERS:
        for view in (False, True):
            four = (name, view) in {("AdamW-fused", False), ("SGD-momentum", True)}
            yield (f"{name}/bucket_view-{view}", _parity,
                   dict(optimizer=name, ddp=dict(gradient_as_bucket_view=view, bucket_cap_mb=0.002)),
                   both if four else (2,))
    for name in ("AdamW-fused", "SGD-momentum", "Adam-foreach"):
        for view in (False, True):
            four = (name, view) in {("AdamW-fused", True), ("SGD-momentum", False)}
            yield (f"find_unused/{name}/bucket_view-{view}", _parity,
                   dict(optimizer=name, unused=True, ddp=dict(find_unused_parameters=True,
                                                              gradient_as_bucket_view=view)),
                   both if four else (2,))
    for find_unused in (False, True):
        yield (f"static_graph/find_unused-{find_unused}/unused_parameters", _parity,
               dict(unused=True, static=True, ddp=dict(static_graph=True, find_unused_parameters=find_unused)), (2,))
    unused = dict(unused=True, ddp=dict(find_unused_parameters=True))
    yield "find_unused/no_sync_accumulation", _parity, dict(unused, steps=3, micro=2), (2,)
    yield ("find_unused/fp16_compress_hook", _parity,
           dict(unused=True, compress=True, ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True)), (2,))
    yield "find_unused/exact_clipping", _parity, dict(unused, clip=0.05), (2,)
    yield "static_graph", _parity, dict(ddp=dict(static_graph=True, bucket_cap_mb=0.002), steps=4), (2,)
    yield "default_buckets", _parity, dict(ddp={}), (2,)
    yield "no_sync_accumulation", _parity, dict(micro=3), both
    yield "ignored_parameters", _parity, dict(ignore=("head.weight", "head.bias")), (2,)
    yield "fp16_compress_hook", _parity, dict(compress=True), (2,)
    yield "exact_clipping", _parity, dict(clip=0.05), (2,)
    for name in ("AdamW-fused", "SGD-momentum"):
        yield f"two_pass_clipping/{name}", _parity, dict(optimizer=name, clip=0.05, two_pass=True), both
    yield "two_pass_clipping/not_clipping", _parity, dict(clip=1e3, two_pass=True), (2,)
    yield "two_pass_clipping/find_unused", _parity, dict(unused, clip=0.05, two_pass=True), (2,)
    yield "two_pass_clipping/no_sync_accumulation", _parity, dict(clip=0.05, two_pass=True, micro=2), (2,)
    yield "two_pass_clipping/gradient_as_bucket_view", _parity, dict(
        clip=0.05, two_pass=True, ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.002)), (2,)
    # DDP's mean multiplies by 1 / world, which rounds unlike a division only where the world is no power of two
    for name, view in (("SGD-momentum", False), ("AdamW-fused", True)):
        yield (f"{name}/bucket_view-{view}/mean_on_3_ranks", _parity,
               dict(optimizer=name, ddp=dict(gradient_as_bucket_view=view, bucket_cap_mb=0.002)), (3,))
    yield "refusals", _refusals, {}, (2,)


SCENARIOS = [
    pytest.param(world, fn, kwargs, id=f"{world}ranks/{name}")
    for name, fn, kwargs, worlds in _scenarios()
    for world in worlds
]


@pytest.mark.parametrize("world, scenario, kwargs", SCENARIOS)
def test_ddp_equals_the_standard_loop(ranks, world, scenario, kwargs):
    ranks.run(world, scenario, **kwargs)


def test_refuses_a_torch_without_the_used_map():
    from types import SimpleNamespace

    from dist_optim.parallel._ddp import check_ddp

    ddp = SimpleNamespace(find_unused_parameters=True, static_graph=False, reducer=object())
    with pytest.raises(NotImplementedError, match="no DDP reducer._get_local_used_map"):
        check_ddp(ddp, 1, None)
    check_ddp(SimpleNamespace(find_unused_parameters=False, static_graph=False, reducer=object()), 1, None)

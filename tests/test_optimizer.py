"""InBackwardOptimizer as a torch.optim.Optimizer: groups, schedulers, hooks, step()/zero_grad(), remove()."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import (
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    train_in_backward,
    train_standard,
    twins,
)
from torch import nn
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    ReduceLROnPlateau,
    SequentialLR,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from dist_optim import InBackwardOptimizer

ADAMW = dict(lr=1e-2, weight_decay=0.1, fused=True)


def test_grads_are_freed_and_params_updated_in_backward():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    loss_of(model, batches(1)[0]).backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is None
        assert not torch.equal(p, b)


def test_accepts_module_named_parameters_tensors_and_groups():
    data = batches(3)
    ref, *models = [make_model() for _ in range(5)]
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    keep = [  # an optimizer steps only while it is referenced, like any optimizer
        InBackwardOptimizer(models[0], torch.optim.AdamW, **ADAMW),
        InBackwardOptimizer(models[1].named_parameters(), torch.optim.AdamW, **ADAMW),
        InBackwardOptimizer(list(models[2].parameters()), torch.optim.AdamW, **ADAMW),
        InBackwardOptimizer([{"params": models[3].parameters()}], torch.optim.AdamW, **ADAMW),
    ]
    train_standard(ref, ref_opt, data)
    for m in models:
        train_in_backward(m, data)
        assert_same_params(m, ref)
    assert len(keep) == 4


def test_module_skips_frozen_parameters():
    model = make_model()
    model.head.weight.requires_grad_(False)
    frozen = model.head.weight.detach().clone()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)
    assert all(p is not model.head.weight for p in opt.param_groups[0]["params"])
    assert "head.weight" not in opt.param_groups[0]["param_names"]
    loss_of(model, batches(1)[0]).backward()
    assert torch.equal(model.head.weight, frozen)


def test_per_group_options_match_standard():
    model, ref = twins()

    def groups(m):
        return [
            {"params": m.layers.parameters(), "lr": 1e-2},
            {"params": list(m.norm.parameters()) + list(m.head.parameters()), "lr": 3e-3, "weight_decay": 0.0},
        ]

    opt = InBackwardOptimizer(groups(model), torch.optim.AdamW, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(groups(ref), weight_decay=0.1, fused=True)
    data = batches(4)
    train_standard(ref, ref_opt, data)
    train_in_backward(model, data)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_muon_for_matrices_adamw_for_the_rest():
    model, ref = twins()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    opt = InBackwardOptimizer(
        [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 2e-2}, {"params": rest}],
        torch.optim.AdamW,
        lr=1e-2,
        foreach=False,
    )
    assert "optimizer_class" not in opt.param_groups[0]
    assert "betas" not in opt.param_groups[0]  # a Muon group takes Muon's defaults, not AdamW's options
    ref_muon = torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], lr=2e-2)
    ref_adamw = torch.optim.AdamW([p for p in ref.parameters() if p.ndim != 2], lr=1e-2, foreach=False)
    for batch in batches(3):
        loss_of(model, batch).backward()
        loss_of(ref, batch).backward()
        ref_muon.step()
        ref_adamw.step()
        ref.zero_grad()
    assert_same_params(model, ref)


def test_lr_change_by_hand_applies_at_next_step():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def change(opt_):
        def hook(k, _loss):
            opt_.param_groups[0]["lr"] = 0.1 / (k + 2)

        return hook

    data = batches(4)
    train_standard(ref, ref_opt, data, change(ref_opt))
    train_in_backward(model, data, change(opt))
    assert_same_params(model, ref)


def _sched_lambda_to_zero(opt):
    return LambdaLR(opt, lambda k: 1.0 if k < 2 else 0.0)


def _sched_cosine(opt):
    return CosineAnnealingLR(opt, T_max=5)


def _sched_chained(opt):
    return ChainedScheduler([ExponentialLR(opt, gamma=0.7), LinearLR(opt, start_factor=0.5, total_iters=3)])


def _sched_sequential(opt):
    return SequentialLR(opt, [LinearLR(opt, start_factor=0.1, total_iters=2), ExponentialLR(opt, 0.5)], [2])


@pytest.mark.parametrize("make_sched", [_sched_lambda_to_zero, _sched_cosine, _sched_chained, _sched_sequential])
def test_lr_schedulers_match_standard_without_warnings(make_sched):
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    sched, ref_sched = make_sched(opt), make_sched(ref_opt)
    data = batches(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        train_in_backward(model, data, lambda k, loss: sched.step())
    train_standard(ref, ref_opt, data, lambda k, loss: ref_sched.step())
    assert_same_params(model, ref)
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_lambda_lr_to_zero_freezes_parameters():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    sched = LambdaLR(opt, lambda k: 0.0)
    loss_of(model, batches(1)[0]).backward()  # lr is 0 from construction on
    sched.step()
    frozen = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batches(1)[0]).backward()
    for p, f in zip(model.parameters(), frozen):
        assert torch.equal(p, f)


def test_reduce_lr_on_plateau_matches_standard():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    sched = ReduceLROnPlateau(opt, factor=0.5, patience=0)
    ref_sched = ReduceLROnPlateau(ref_opt, factor=0.5, patience=0)
    data = batches(6)
    plateau = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]  # a metric that stalls: the lr must drop, several times
    train_in_backward(model, data, lambda k, loss: sched.step(plateau[k]))
    train_standard(ref, ref_opt, data, lambda k, loss: ref_sched.step(plateau[k]))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.1
    assert_same_params(model, ref)


def test_step_hooks_fire_once_per_training_step_with_the_facade():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=1e-4, **ADAMW)
    assert len(list(model.parameters())) > 2
    events = []
    weight_before = []

    def pre(o, args, kwargs):
        events.append(("pre", o is opt))
        weight_before.append(model.head.weight.detach().clone())

    handles = [
        opt.register_step_pre_hook(pre),
        opt.register_step_post_hook(lambda o, a, k: events.append(("post", o is opt))),
        register_optimizer_step_pre_hook(lambda o, a, k: events.append(("global pre", o is opt))),
        register_optimizer_step_post_hook(lambda o, a, k: events.append(("global post", o is opt))),
    ]
    try:
        start = model.head.weight.detach().clone()
        for batch in batches(2):
            loss_of(model, batch).backward()
            opt.step()  # an old loop that still calls step() and zero_grad() must not fire the hooks twice
            opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    one_step = [("global pre", True), ("pre", True), ("post", True), ("global post", True)]
    assert events == one_step * 2
    assert torch.equal(weight_before[0], start)  # pre-hooks run before any parameter changes


def test_loop_that_still_calls_step_and_zero_grad_trains_identically():
    model, other = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    opt2 = InBackwardOptimizer(other.parameters(), torch.optim.AdamW, **ADAMW)
    data = batches(4)
    train_in_backward(model, data)
    for batch in data:
        opt2.zero_grad()
        loss_of(other, batch).backward()
        opt2.step()
    assert_same_params(model, other)
    assert_same_state(opt.state_dict(), opt2.state_dict())


def test_step_with_closure_runs_backward_once():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = batches(1)[0]

    def closure(m, o):
        def fn():
            o.zero_grad()
            loss = loss_of(m, batch)
            loss.backward()
            return loss

        return fn

    assert opt.step(closure(model, opt)).item() == ref_opt.step(closure(ref, ref_opt)).item()
    assert_same_params(model, ref)


def test_add_param_group_later():
    model, ref = twins()
    opt = InBackwardOptimizer(model.layers.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.layers.parameters(), lr=0.1)
    data = batches(4)
    train_in_backward(model, data[:2])
    train_standard(ref, ref_opt, data[:2])
    opt.add_param_group({"params": list(model.norm.parameters()) + list(model.head.parameters()), "lr": 0.05})
    ref_opt.add_param_group({"params": list(ref.norm.parameters()) + list(ref.head.parameters()), "lr": 0.05})
    train_in_backward(model, data[2:])
    train_standard(ref, ref_opt, data[2:])
    assert_same_params(model, ref)


def test_remove_detaches_and_leaves_a_standard_optimizer():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    data = batches(4)
    train_in_backward(model, data[:2])
    train_standard(ref, ref_opt, data[:2])
    opt.remove()
    loss_of(model, data[2]).backward()
    assert all(p.grad is not None for p in model.parameters())  # nothing stepped or freed in backward any more
    opt.step()  # now a plain AdamW step over the same state
    opt.zero_grad()
    loss_of(ref, data[2]).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_same_params(model, ref)
    # and a brand-new standard optimizer can take over the model
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh.load_state_dict(fresh.state_dict())
    loss_of(model, data[3]).backward()
    assert model.head.weight.grad is not None
    fresh.step()


def test_swap_in_optimizer_params_and_state_matches_standard():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    data = batches(2)
    train_in_backward(model, data)
    train_standard(ref, ref_opt, data)

    def swapped_step(m, o):
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        for p in params.values():
            p.grad = torch.ones_like(p)
        osd = copy.deepcopy(o.state_dict())
        with torch.optim.swap_in_optimizer_params_and_state(o, params, osd):
            o.step()
        return params, osd

    params, osd = swapped_step(model, opt)
    ref_params, ref_osd = swapped_step(ref, ref_opt)
    for name in params:
        assert torch.equal(params[name], ref_params[name])
    assert_same_state(osd, ref_osd)
    assert_same_params(model, ref)  # the live parameters were untouched
    assert all(p.grad is None for p in model.parameters())


def test_configured_options_are_readable_and_buckets_are_listed():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, accumulation_steps=2,
                              max_grad_norm=1.5, clip_mode="per_parameter", max_grad_value=3.0, per_parameter=True)
    assert (opt.accumulation_steps, opt.max_grad_norm, opt.clip_mode, opt.max_grad_value, opt.grad_norm_type) == (
        2, 1.5, "per_parameter", 3.0, 2.0)
    assert opt.buckets == ()
    for batch in batches(2):
        loss_of(model, batch).backward()
    params = list(model.parameters())
    assert sorted(map(id, (p for b in opt.buckets for p in b))) == sorted(map(id, params))
    assert all(len(b) == 1 for b in opt.buckets)


def test_configure_clipping_equals_giving_the_options_at_construction():
    a, b = twins()
    data = batches(4)
    ref = InBackwardOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05, max_grad_value=0.01)
    opt = InBackwardOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2)
    opt.configure_clipping(max_grad_norm=0.05, max_grad_value=0.01)
    assert (opt.max_grad_norm, opt.clip_mode, opt.max_grad_value) == (0.05, "exact", 0.01)
    train_in_backward(a, data)
    train_in_backward(b, data)
    assert_same_params(a, b)
    assert ref.last_step.clip_coef is not None and torch.equal(ref.grad_norm, opt.grad_norm)
    opt.configure_clipping(max_grad_norm=None)
    assert (opt.max_grad_norm, opt.max_grad_value) == (None, 0.01)
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        opt.configure_clipping(clip_mode="global")
    assert opt.clip_mode == "exact"  # a refused change leaves the options as they were


def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _drosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return torch.stack((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


def _rosenbrock_sparse(make_opt) -> torch.Tensor:
    """torch's test_optim ``test_rosenbrock_sparse``: the closure's backward, then sparse gradients set by hand."""
    params = torch.tensor([1.5, 1.5], dtype=torch.float64, requires_grad=True)
    opt = make_opt([params])
    for i in range(100):
        def closure():
            opt.zero_grad()
            loss = _rosenbrock(params)
            loss.backward()
            g = _drosenbrock(params.detach())
            k = i % 2
            params.grad = torch.sparse_coo_tensor(torch.tensor([[k]]), g[k:k + 1], (2,))
            return loss

        opt.step(closure)
    return params.detach()


def test_a_closure_that_sets_gradients_after_its_backward_steps_on_them():
    # As torch.optim: the step uses exactly the gradients the closure leaves (here sparse, set after its backward,
    # which only accumulated); both sides take Adagrad's for-loop, the one path torch has for sparse gradients.
    got = _rosenbrock_sparse(lambda p: InBackwardOptimizer(p, torch.optim.Adagrad, lr=0.1))
    want = _rosenbrock_sparse(lambda p: torch.optim.Adagrad(p, lr=0.1))
    assert torch.equal(got, want) and not torch.equal(got, torch.tensor([1.5, 1.5], dtype=torch.float64))


def test_the_closure_s_backward_only_accumulates_and_step_steps_once():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    stepped = []
    opt.register_bucket_step_hook(lambda o, params: stepped.append(len(params)))
    for batch in batches(2):
        def closure(m=model, o=opt, b=batch):
            o.zero_grad()
            for half in (b[0][:3], b[0][3:]):  # two backwards in one closure: their sum is stepped, once
                nn.functional.mse_loss(m(half), b[1][:3]).backward()
            return None

        def ref_closure(m=ref, o=ref_opt, b=batch):
            o.zero_grad()
            for half in (b[0][:3], b[0][3:]):
                nn.functional.mse_loss(m(half), b[1][:3]).backward()
            return None

        opt.step(closure)
        ref_opt.step(ref_closure)
    assert stepped == [10, 10]  # one standard step per step() call, all tensors at once
    assert_same_params(model, ref)


def test_kernels_says_the_flag_chosen_for_each_group_that_left_both_unset():
    model = make_model()
    own, rest = list(model.parameters())[:1], list(model.parameters())[1:]
    opt = InBackwardOptimizer([{"params": own, "foreach": False}, {"params": rest}], torch.optim.AdamW)
    assert opt.kernels == ({}, {"fused": True})  # the group's own flag is its own; torch's fastest for the other
    opt.kernels[1]["fused"] = False  # a copy
    assert opt.kernels[1] == {"fused": True}
    sgd = InBackwardOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1)
    assert sgd.kernels == ({"foreach": True},)  # never fused SGD


def test_optimizer_classes_and_kwargs_per_group():
    model = make_model()
    params = list(model.parameters())
    opt = InBackwardOptimizer(
        [{"params": params[:2]}, {"params": params[2:], "optimizer_class": torch.optim.SGD, "lr": 0.1}],
        torch.optim.AdamW, lr=1e-3, betas=(0.8, 0.9))
    assert opt.optimizer_classes == (torch.optim.AdamW, torch.optim.SGD)
    assert opt.optimizer_kwargs == ({"lr": 1e-3, "betas": (0.8, 0.9)}, {})
    opt.optimizer_kwargs[0]["lr"] = 5.0  # a copy: the optimizer keeps its own
    assert opt.optimizer_kwargs[0]["lr"] == 1e-3

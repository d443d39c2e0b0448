"""average_in_backward: the AveragedModel (EMA, SWA, custom averages) is bitwise the one that update_parameters(model)
after every standard step gives, with buffers, SWALR, update_bn, unused parameters, checkpoints and any buckets."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import ADAMW, assert_same_params, batches, loss_of, make_model, twins
from torch import nn
from torch.optim.swa_utils import (
    SWALR,
    AveragedModel,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_multi_avg_fn,
    update_bn,
)

import dist_optim.averaging
from dist_optim import InBackwardOptimizer
from dist_optim.averaging import average_in_backward

ENGINES = [{}, {"bucket_cap_mb": 1e-4}, {"per_parameter": True}]
ENGINE_IDS = ["one-bucket", "tiny-buckets", "per-parameter"]


def _custom_avg_fn(averaged, current, n):
    return averaged + (current - averaged) * 0.3 / (n + 1)  # uses n_averaged, so its counting is checked too


def _custom_multi_avg_fn(averaged, current, n):
    torch._foreach_mul_(averaged, 0.6)
    torch._foreach_add_(averaged, torch._foreach_mul(current, 0.4 / (n.item() + 1)))


AVERAGES = {
    "ema-multi": dict(multi_avg_fn=get_ema_multi_avg_fn(0.9)),
    "ema-avg_fn": dict(avg_fn=get_ema_avg_fn(0.9)),
    "swa-default": dict(),
    "swa-multi": dict(multi_avg_fn=get_swa_multi_avg_fn()),
    "custom-avg_fn": dict(avg_fn=_custom_avg_fn),
    "custom-multi_avg_fn": dict(multi_avg_fn=_custom_multi_avg_fn),
}


def standard_step(model, opt, avg, batch):
    loss_of(model, batch).backward()
    opt.step()
    opt.zero_grad()
    if avg is not None:
        avg.update_parameters(model)


def assert_same_averaged(a: AveragedModel, b: AveragedModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs: {sa[key]} vs {sb[key]}"


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("average", list(AVERAGES))
def test_averaged_model_is_bitwise_the_standard_loops(average, engine):
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **engine, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    avg, ref_avg = AveragedModel(model, **AVERAGES[average]), AveragedModel(ref, **AVERAGES[average])
    average_in_backward(opt, avg, model)
    for batch in batches(4):
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
    assert_same_params(model, ref)
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == 4
    assert not torch.equal(avg.module.head.weight, model.head.weight)  # really an average, not a copy


@pytest.mark.parametrize("engine", ENGINES[1:], ids=ENGINE_IDS[1:])
def test_each_bucket_is_averaged_in_backward_right_after_its_step(engine):
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, **engine)
    ema = get_ema_multi_avg_fn(0.9)
    calls = []

    def recording(averaged, current, n):
        calls.append(len(averaged))
        ema(averaged, current, n)

    avg = AveragedModel(model, multi_avg_fn=recording)
    average_in_backward(opt, avg, model)
    order = []  # per bucket: does its average differ from the just-stepped parameters?

    def after_ours(_opt, stepped):
        names = [n for n, p in model.named_parameters() if any(p is s for s in stepped)]
        order.append(all(not torch.equal(avg.module.get_parameter(n), model.get_parameter(n)) for n in names))

    opt.register_bucket_step_hook(after_ours)  # a bucket hook that runs after ours, before the next bucket
    data = batches(3)
    loss_of(model, data[0]).backward()  # n_averaged == 0: copies, no call of the average
    assert calls == []
    for batch in data[1:]:
        loss_of(model, batch).backward()
    n_params = len(list(model.parameters()))
    assert sum(calls) == 2 * n_params  # every parameter once per step, none at the end of the step
    assert len(calls) > 2  # in several bucket-sized calls
    if engine.get("per_parameter"):
        assert calls == [1] * (2 * n_params)
    # Step 1 copied each bucket before the next hook saw it; later steps leave an average unlike the model.
    per_step = len(order) // 3
    assert per_step > 1 and order == [False] * per_step + [True] * (2 * per_step)


@pytest.mark.parametrize("use_buffers", [False, True], ids=["buffers-copied", "buffers-averaged"])
@pytest.mark.parametrize("average", ["ema-multi", "swa-default"])
def test_batchnorm_buffers_and_update_bn_match_standard(use_buffers, average):
    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    model, ref = make(), make()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=1e-3, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    kwargs = dict(**AVERAGES[average], use_buffers=use_buffers)
    avg, ref_avg = AveragedModel(model, **kwargs), AveragedModel(ref, **kwargs)
    average_in_backward(opt, avg, model)
    data = batches(4)
    for batch in data:
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
    assert_same_averaged(avg, ref_avg)  # running_mean/var and num_batches_tracked included
    bn, model_bn = avg.module[1], model[1]
    assert torch.equal(bn.running_mean, model_bn.running_mean) != use_buffers
    loader = [x for x, _ in data]
    update_bn(loader, avg)
    update_bn(loader, ref_avg)
    assert_same_averaged(avg, ref_avg)
    assert int(bn.num_batches_tracked) == len(loader)
    with torch.no_grad():
        assert torch.equal(avg.eval()(data[0][0]), ref_avg.eval()(data[0][0]))


def test_swalr_on_the_facade_and_swa_from_a_later_epoch_match_standard():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)  # same kernel: bitwise
    scheds = [(torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6), SWALR(o, swa_lr=0.02, anneal_epochs=2))
              for o in (opt, ref_opt)]
    avg, ref_avg = AveragedModel(model), AveragedModel(ref)
    swa_start, data = 2, batches(3)
    lrs, ref_lrs = [], []
    for epoch in range(5):
        if epoch == swa_start:
            average_in_backward(opt, avg, model)  # SWA starts here: attach now
        for batch in data:
            loss_of(model, batch).backward()
            standard_step(ref, ref_opt, ref_avg if epoch >= swa_start else None, batch)
        for (sched, swa_sched), out, o in zip(scheds, (lrs, ref_lrs), (opt, ref_opt)):
            (swa_sched if epoch >= swa_start else sched).step()
            out.append(o.param_groups[0]["lr"])
    assert lrs == ref_lrs and lrs[-1] == 0.02
    assert_same_params(model, ref)
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == (5 - swa_start) * len(data)


class Branchy(nn.Module):
    """Head ``b`` is used only on even steps; ``scale`` is frozen, so no optimizer steps it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.trunk = nn.Linear(8, 8)
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.trunk(x)) * self.scale
        return self.a(h) + self.b(h) if self.use_b else self.a(h)


@pytest.mark.parametrize("average", ["ema-multi", "swa-default", "custom-avg_fn"])
def test_unused_and_frozen_parameters_are_averaged_at_the_end_of_the_step(average):
    model, ref = Branchy(), Branchy()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=1e-4, **ADAMW)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    avg, ref_avg = AveragedModel(model, **AVERAGES[average]), AveragedModel(ref, **AVERAGES[average])
    average_in_backward(opt, avg, model)
    for k, batch in enumerate(batches(5)):
        model.use_b = ref.use_b = k % 2 == 0
        b_model, b_avg = model.b.weight.detach().clone(), avg.module.b.weight.detach().clone()
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
        if not model.use_b:
            assert torch.equal(model.b.weight, b_model)  # not stepped ...
            if k > 1:  # (once the average has moved away from the model)
                assert not torch.equal(avg.module.b.weight, b_avg)  # ... but averaged, as update_parameters does
    assert_same_params(model, ref)
    assert_same_averaged(avg, ref_avg)


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 1).double()

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)).double()).float()


@pytest.mark.parametrize("average", ["ema-multi", "swa-multi", "custom-multi_avg_fn"])
def test_float32_and_float64_groups_match_standard(average):
    model, ref = MixedDtypes(), MixedDtypes()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, per_parameter=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    avg, ref_avg = AveragedModel(model, **AVERAGES[average]), AveragedModel(ref, **AVERAGES[average])
    average_in_backward(opt, avg, model)
    for batch in batches(4):
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
    assert avg.module.second.weight.dtype == torch.float64
    assert_same_params(model, ref)
    assert_same_averaged(avg, ref_avg)


def test_checkpoint_round_trip_continues_bitwise_in_either_loop():
    ema = dict(multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    data = batches(6)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ref_avg = AveragedModel(ref, **ema)
    for batch in data:
        standard_step(ref, ref_opt, ref_avg, batch)

    model = make_model()
    opt = InBackwardOptimizer(model.named_parameters(), torch.optim.AdamW, bucket_cap_mb=1e-4, **ADAMW)
    avg = AveragedModel(model, **ema)
    average_in_backward(opt, avg, model)
    for batch in data[:3]:
        loss_of(model, batch).backward()
    blob = saved({"model": model.state_dict(), "opt": opt.state_dict(), "avg": avg.state_dict()})
    ckpt = loaded(blob)  # a fresh copy per resume: load_state_dict may keep the loaded tensors as the state
    assert int(ckpt["avg"]["n_averaged"]) == 3

    resumed = make_model(seed=11)  # other values everywhere: the checkpoint must bring them all
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = InBackwardOptimizer(resumed.named_parameters(), torch.optim.AdamW, bucket_cap_mb=1e-4, **ADAMW)
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_avg = AveragedModel(resumed, **ema)  # the averaging functions are not in a state_dict
    resumed_avg.load_state_dict(ckpt["avg"])
    average_in_backward(resumed_opt, resumed_avg, resumed)
    for batch in data[3:]:
        loss_of(resumed, batch).backward()
    assert_same_params(resumed, ref)
    assert_same_averaged(resumed_avg, ref_avg)
    assert int(resumed_avg.n_averaged) == 6

    ckpt = loaded(blob)
    std = make_model(seed=11)  # the same checkpoint resumes in the standard loop too
    std.load_state_dict(ckpt["model"])
    std_opt = torch.optim.AdamW(std.parameters(), **ADAMW)
    std_opt.load_state_dict(ckpt["opt"])
    std_avg = AveragedModel(std, **ema)
    std_avg.load_state_dict(ckpt["avg"])
    for batch in data[3:]:
        standard_step(std, std_opt, std_avg, batch)
    assert_same_averaged(std_avg, ref_avg)


@pytest.fixture(params=[False, True], ids=["n-read-each-step", "n-remembered"])
def remembered_n(request, monkeypatch):
    """On an accelerator n_averaged is remembered between steps (no sync); exercise that path on the CPU too."""
    if request.param:
        monkeypatch.setattr(dist_optim.averaging, "_reading_syncs", lambda t: True)
    return request.param


def test_state_dict_loaded_into_the_attached_averaged_model_is_followed(remembered_n):
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)  # same kernel: bitwise
    avg, ref_avg = AveragedModel(model), AveragedModel(ref)
    empty = copy.deepcopy(avg.state_dict())  # n_averaged == 0
    average_in_backward(opt, avg, model)
    data = batches(7)
    for batch in data[:2]:
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
    snapshot = copy.deepcopy(avg.state_dict())
    loss_of(model, data[2]).backward()
    avg.load_state_dict(snapshot)  # roll the average back one step (n_averaged 3 -> 2), in place
    ref_avg.load_state_dict(snapshot)
    ref_opt.load_state_dict(opt.state_dict())
    ref.load_state_dict(model.state_dict())
    for batch in data[3:5]:
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg, batch)
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == 4
    avg.load_state_dict(empty)  # restart the average: the next step copies again
    ref_avg.load_state_dict(empty)
    loss_of(model, data[5]).backward()
    standard_step(ref, ref_opt, ref_avg, data[5])
    assert_same_params(avg.module, model)
    loss_of(model, data[6]).backward()
    standard_step(ref, ref_opt, ref_avg, data[6])
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == 2


def test_remove_stops_averaging_and_attaching_again_resumes(remembered_n):
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    ref_avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    averaged_steps = {0, 1, 4, 5}
    handle = average_in_backward(opt, avg, model)
    for k, batch in enumerate(batches(6)):
        if k == 2:
            handle.remove()  # stop; the average stays as it is
            frozen = copy.deepcopy(avg.state_dict())
        if k == 4:
            assert all(torch.equal(v, frozen[key]) for key, v in avg.state_dict().items())
            handle = average_in_backward(opt, avg, model)  # resume from its n_averaged
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, ref_avg if k in averaged_steps else None, batch)
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == len(averaged_steps)


def test_several_averaged_models_follow_one_optimizer():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=1e-4, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    decays = (0.9, 0.99)
    avgs = [AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d)) for d in decays]
    ref_avgs = [AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(d)) for d in decays]
    for a in avgs:
        average_in_backward(opt, a, model)
    for batch in batches(4):
        loss_of(model, batch).backward()
        standard_step(ref, ref_opt, None, batch)
        for a in ref_avgs:
            a.update_parameters(ref)
    for a, r in zip(avgs, ref_avgs):
        assert_same_averaged(a, r)
    assert not torch.equal(avgs[0].module.head.weight, avgs[1].module.head.weight)


def test_backward_that_raises_midway_leaves_n_averaged_and_the_next_step_counts_once():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, per_parameter=True)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    average_in_backward(opt, avg, model)
    data = batches(3)
    loss_of(model, data[0]).backward()
    head, first = avg.module.head.weight.detach().clone(), avg.module.layers[0].weight.detach().clone()

    def fail(_grad):
        raise RuntimeError("boom")

    x, y = data[1]
    h = torch.tanh(model.layers[0](x))
    h.register_hook(fail)  # the head's bucket steps before this runs, layers[0]'s never does
    for layer in model.layers[1:]:
        h = torch.tanh(layer(h))
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.mse_loss(model.head(model.norm(h)), y).backward()
    assert int(avg.n_averaged) == 1
    assert not torch.equal(avg.module.head.weight, head)  # stepped, so averaged
    assert torch.equal(avg.module.layers[0].weight, first)
    model.zero_grad()
    loss_of(model, data[2]).backward()
    assert int(avg.n_averaged) == 2
    assert not torch.equal(avg.module.layers[0].weight, first)


def test_gradients_stepped_by_a_plain_step_call_are_averaged_too():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    average_in_backward(opt, avg, model)
    for k, batch in enumerate(batches(3)):
        for p, q in zip(model.parameters(), ref.parameters()):  # gradients set by hand, not in backward
            p.grad, q.grad = torch.full_like(p, 0.1 * (k + 1)), torch.full_like(q, 0.1 * (k + 1))
        opt.step()
        ref_opt.step()
        ref_avg.update_parameters(ref)
    assert_same_params(model, ref)
    assert_same_averaged(avg, ref_avg)
    assert int(avg.n_averaged) == 3


def test_refusals_name_the_fix():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)
    avg = AveragedModel(model)
    with pytest.raises(ValueError, match=r"has 8 parameters but model has 10; build the averaged model from"):
        average_in_backward(opt, AveragedModel(make_model(depth=2)), model)
    with pytest.raises(ValueError, match=r"parameters 0 has shape \(4, 4\) in averaged_model but \(8, 8\)"):
        average_in_backward(opt, AveragedModel(make_model(width=4)), model)
    with_bn = AveragedModel(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))  # same parameter shapes
    with pytest.raises(ValueError, match=r"averaged_model has 3 buffers but model has 0"):
        average_in_backward(opt, with_bn, nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    with pytest.raises(TypeError, match=r"must be a torch.optim.swa_utils.AveragedModel.*AveragedModel\(model"):
        average_in_backward(opt, copy.deepcopy(model), model)
    with pytest.raises(TypeError, match=r"got SGD; with a standard optimizer call averaged_model.update_parameters"):
        average_in_backward(torch.optim.SGD(model.parameters(), lr=0.1), avg, model)
    with pytest.raises(ValueError, match="optimizer steps none of model's parameters"):
        average_in_backward(opt, AveragedModel(model), make_model())
    with pytest.raises(ValueError, match="model is the averaged model itself"):
        average_in_backward(opt, avg, avg)
    handle = average_in_backward(opt, avg, model)
    with pytest.raises(ValueError, match=r"already averaged in backward by InBackwardOptimizer.*\.remove\(\)"):
        average_in_backward(opt, avg, model)
    handle.remove()
    average_in_backward(opt, avg, model)  # allowed again once removed
    loss_of(model, batches(1)[0]).backward()
    assert int(avg.n_averaged) == 1  # averaged once per step, not twice

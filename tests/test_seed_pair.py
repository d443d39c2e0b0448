"""The seed-compatible pair: apply_optimizer_in_backward / get_in_backward_optimizers."""

from __future__ import annotations

import copy
import gc
import weakref

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
from torch.distributed.optim import (
    _apply_optimizer_in_backward,
    _get_in_backward_optimizers,
)

from dist_optim import (
    InBackwardOptimizer,
    apply_optimizer_in_backward,
    get_in_backward_optimizers,
)


@pytest.mark.parametrize(
    "cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 1e-2})]
)
def test_same_result_as_torch_private_function_and_the_standard_loop(cls, kwargs):
    ours, theirs = twins()
    ref = copy.deepcopy(ours)
    apply_optimizer_in_backward(cls, ours.parameters(), kwargs)
    _apply_optimizer_in_backward(cls, theirs.parameters(), kwargs)
    data = batches(4)
    train_in_backward(ours, data)
    train_in_backward(theirs, data)
    train_standard(ref, cls(ref.parameters(), **kwargs), data)
    assert_same_params(ours, theirs)
    assert_same_params(ours, ref)
    assert all(p.grad is None for p in ours.parameters())
    ours_sd = [o.state_dict() for o in get_in_backward_optimizers(ours)]
    theirs_sd = [o.state_dict() for o in _get_in_backward_optimizers(theirs)]
    assert len(ours_sd) == len(theirs_sd) == len(list(ours.parameters()))
    for a, b in zip(ours_sd, theirs_sd):
        assert a["param_groups"] == b["param_groups"]
        for key, v in a["state"][0].items():
            assert torch.equal(v, b["state"][0][key])


def test_several_optimizers_per_parameter_each_step_once():
    model, ref = twins()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-2})
    assert len(get_in_backward_optimizers(model)) == 2 * len(list(model.parameters()))
    sgd, adam = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for batch in batches(3):
        loss_of(model, batch).backward()
        loss_of(ref, batch).backward()
        sgd.step()
        adam.step()
        ref.zero_grad()
    assert_same_params(model, ref)
    for opt in get_in_backward_optimizers(model)[1::2]:
        assert next(iter(opt.state.values()))["step"].item() == 3


def test_shared_parameter_steps_once_per_backward():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(3, 4, generator=g)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert len(get_in_backward_optimizers(model)) == 3  # a.weight (shared), a.bias, b.bias


def test_register_hook_false_records_without_stepping():
    model = make_model()
    before = model.head.weight.detach().clone()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1}, register_hook=False)
    assert len(get_in_backward_optimizers(model)) == len(list(model.parameters()))
    loss_of(model, batches(1)[0]).backward()
    assert torch.equal(model.head.weight, before) and model.head.weight.grad is not None
    # a later call with the hook steps every recorded optimizer, as torch's does
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    model.zero_grad()
    loss_of(model, batches(1)[0]).backward()
    assert model.head.weight.grad is None and not torch.equal(model.head.weight, before)


def test_dropping_the_model_frees_it():
    model = make_model()
    apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": 1e-2})
    loss_of(model, batches(1)[0]).backward()
    refs = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert all(r() is None for r in refs)


def test_follows_module_to_a_new_dtype():
    model, ref = twins()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    data = batches(3)
    train_in_backward(model, data[:1])
    train_standard(ref, ref_opt, data[:1])
    model.double()  # `param.data = ...` under the hood: the optimizers must follow the new storage
    ref.double()
    for opt in [ref_opt, *get_in_backward_optimizers(model)]:
        for s in opt.state.values():
            s["momentum_buffer"] = s["momentum_buffer"].double()
    double = [(x.double(), y.double()) for x, y in data[1:]]
    train_in_backward(model, double)
    train_standard(ref, ref_opt, double)
    assert_same_params(model, ref)
    assert model.head.weight.dtype == torch.float64


def test_pair_and_facade_cannot_both_consume_a_gradient():
    model = make_model()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="already stepped in backward"):
        InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    other = make_model()
    opt = InBackwardOptimizer(other.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="already stepped in backward by InBackwardOptimizer"):
        apply_optimizer_in_backward(torch.optim.SGD, other.parameters(), {"lr": 0.1})
    assert opt is not None


def test_optimizers_hold_the_models_own_parameters_as_torch_lays_them_out():
    ours, theirs = twins()
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, ours.parameters(), {"lr": 1e-2}, register_hook=False)
    _apply_optimizer_in_backward(torch.optim.SGD, theirs.parameters(), {"lr": 0.1})
    _apply_optimizer_in_backward(torch.optim.Adam, theirs.parameters(), {"lr": 1e-2}, register_hook=False)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert [type(o) for o in p._in_backward_optimizers] == [type(o) for o in q._in_backward_optimizers]
        assert p._optimizer_classes == q._optimizer_classes and p._optimizer_kwargs == q._optimizer_kwargs
        assert all(o.param_groups[0]["params"] == [p] and o.param_groups[0]["params"][0] is p
                   for o in p._in_backward_optimizers)
    opts = get_in_backward_optimizers(ours)
    assert [o.param_groups[0]["params"][0] for o in opts] == [p for p in ours.parameters() for _ in range(2)]
    # code that pairs an optimizer's params with the module's names finds every one
    names = {p: n for n, p in ours.named_parameters()}
    assert [names[o.param_groups[0]["params"][0]] for o in opts[::2]] == [n for n, _ in ours.named_parameters()]


def test_stepping_the_optimizers_by_hand_updates_the_model_like_a_standard_optimizer():
    # torchtune's memory test: set .grad by hand, call each in-backward optimizer's step()
    model, ref = twins()
    apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": 1e-2})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.grad = torch.rand(p.shape, generator=g)
                q.grad = p.grad.clone()
        for opt in get_in_backward_optimizers(model):
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    saved = [copy.deepcopy(o.state_dict()) for o in get_in_backward_optimizers(model)]
    other = make_model()
    apply_optimizer_in_backward(torch.optim.AdamW, other.parameters(), {"lr": 1e-2})
    for opt, sd in zip(get_in_backward_optimizers(other), saved):
        opt.load_state_dict(sd)
    for opt, sd in zip(get_in_backward_optimizers(other), saved):
        assert_same_state(opt.state_dict(), sd)


def test_dropping_the_model_frees_it_after_its_hooks_are_removed():
    from torch.distributed.optim.apply_optimizer_in_backward import (
        param_to_optim_hook_handle_map,
    )

    model = make_model()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
    loss_of(model, batches(1)[0]).backward()
    for p in model.parameters():  # what DDP does when it takes the step over
        for handle in param_to_optim_hook_handle_map.get(p, []):
            handle.remove()
    refs = [weakref.ref(p) for p in model.parameters()]
    del model, p
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("flatten", [False, True])  # torchtitan saves flattened
@pytest.mark.parametrize(
    "cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]
)
def test_dcp_optimizer_state_dict_over_the_pair_resumes_exactly(tmp_path, cls, kwargs, flatten):
    # torchtitan's way of saving: get_optimizer_state_dict(model, get_in_backward_optimizers(model))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    data = batches(6)
    model, ref = twins()
    apply_optimizer_in_backward(cls, model.parameters(), kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    train_in_backward(model, data[:3])
    train_standard(ref, ref_opt, data[:3])
    osd = get_optimizer_state_dict(model, get_in_backward_optimizers(model))
    _assert_same_fqn_state(osd, get_optimizer_state_dict(ref, ref_opt))
    assert len(osd["param_groups"]) == len(list(model.parameters()))  # one group per in-backward optimizer
    saved = get_optimizer_state_dict(model, get_in_backward_optimizers(model), options=options)
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=str(tmp_path))

    resumed = make_model(seed=5)
    apply_optimizer_in_backward(cls, resumed.parameters(), kwargs)
    opts = get_in_backward_optimizers(resumed)
    target = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opts, options=options)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_model_state_dict(resumed, target["model"])
    set_optimizer_state_dict(resumed, opts, target["optim"], options=options)
    train_in_backward(resumed, data[3:])
    train_standard(ref, ref_opt, data[3:])
    assert_same_params(resumed, ref)
    _assert_same_fqn_state(get_optimizer_state_dict(resumed, opts), get_optimizer_state_dict(ref, ref_opt))


def _assert_same_fqn_state(ours: dict, ref: dict) -> None:
    assert ours["state"].keys() == ref["state"].keys()
    for fqn, state in ref["state"].items():
        assert state.keys() == ours["state"][fqn].keys()
        for key, v in state.items():
            assert torch.equal(ours["state"][fqn][key], v), f"{fqn}[{key!r}]"
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]]
    assert all(h == {k: v for k, v in ref["param_groups"][0].items() if k != "params"} for h in hyper)


def test_a_shared_weight_listed_twice_steps_twice_like_a_standard_optimizer_given_it_twice():
    # torch's test_apply_optimizer_in_backward_shared_params: different options for weights and biases
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    ref[0].weight = ref[1].weight
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref_opts = [torch.optim.SGD([m.weight for m in ref], lr=1.0), torch.optim.SGD([m.bias for m in ref], lr=0.5)]
    apply_optimizer_in_backward(torch.optim.SGD, [m.weight for m in model], {"lr": 1.0})
    apply_optimizer_in_backward(torch.optim.SGD, [m.bias for m in model], {"lr": 0.5})
    assert len(model[0].weight._in_backward_optimizers) == 2
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        ref(x).sum().backward()
        model(x).sum().backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_same_params(model, ref)

"""state_dict()/load_state_dict(): the wrapped optimizer's own format, resume across modes, and the three
name-remapping pre-hooks of the torch.optim documentation run as written against the facade."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import (
    ADAMW,
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    train_in_backward,
    train_standard,
    twins,
)
from torch import nn, optim

from dist_optim import InBackwardOptimizer


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "cls,kwargs",
    [(optim.AdamW, ADAMW), (optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)), (optim.Adagrad, dict(lr=0.1, fused=True))],
    ids=["AdamW", "SGD", "Adagrad"],
)
def test_state_dict_has_the_wrapped_optimizers_format_with_every_parameter(cls, kwargs):
    model, ref = twins()
    opt = InBackwardOptimizer(model.named_parameters(), cls, bucket_cap_mb=1e-4, **kwargs)
    ref_opt = cls(ref.named_parameters(), **kwargs)
    data = batches(3)
    train_in_backward(model, data)
    train_standard(ref, ref_opt, data)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert_same_state(sd, ref_sd)
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    assert len(sd["state"]) == len(list(model.parameters()))
    assert_same_state(roundtrip(sd), ref_sd)  # loads with weights_only=True: plain tensors and numbers only


def test_state_dict_before_any_step_changes_nothing():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), optim.AdamW, **ADAMW)
    sd = opt.state_dict()
    assert sd["state"] == {} and opt.state == {}
    ref = make_model()
    ref_opt = optim.AdamW(ref.parameters(), **ADAMW)
    opt.load_state_dict(sd)
    train_in_backward(model, batches(2))
    train_standard(ref, ref_opt, batches(2))
    assert_same_params(model, ref)


@pytest.mark.parametrize("direction", ["standard->in_backward", "in_backward->standard"])
def test_resume_across_modes_continues_identically(direction):
    data = batches(6)
    uninterrupted = make_model()
    u_opt = optim.AdamW(uninterrupted.named_parameters(), **ADAMW)
    u_sched = optim.lr_scheduler.CosineAnnealingLR(u_opt, T_max=6)
    train_standard(uninterrupted, u_opt, data, lambda k, loss: u_sched.step())

    first = make_model()
    if direction == "standard->in_backward":
        opt = optim.AdamW(first.named_parameters(), **ADAMW)
        sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
        train_standard(first, opt, data[:3], lambda k, loss: sched.step())
    else:
        opt = InBackwardOptimizer(first.named_parameters(), optim.AdamW, **ADAMW)
        sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
        train_in_backward(first, data[:3], lambda k, loss: sched.step())
    checkpoint = roundtrip({"model": first.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})

    resumed = make_model(seed=123)  # different initial weights: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    if direction == "standard->in_backward":
        opt2 = InBackwardOptimizer(resumed.named_parameters(), optim.AdamW, **ADAMW)
    else:
        opt2 = optim.AdamW(resumed.named_parameters(), **ADAMW)
    opt2.load_state_dict(checkpoint["optim"])
    sched2 = optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=6)
    sched2.load_state_dict(checkpoint["sched"])
    if direction == "standard->in_backward":
        train_in_backward(resumed, data[3:], lambda k, loss: sched2.step())
    else:
        train_standard(resumed, opt2, data[3:], lambda k, loss: sched2.step())
    assert_same_params(resumed, uninterrupted)
    assert_same_state(opt2.state_dict(), u_opt.state_dict())


def test_load_state_dict_pre_and_post_hooks_run():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), optim.SGD, lr=0.1)
    calls = []

    def pre(o, sd):
        calls.append("pre")
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.5
        return sd

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post"] and opt.param_groups[0]["lr"] == 0.5
    before = model.head.weight.detach().clone()
    loss_of(model, batches(1)[0]).backward()
    grad_free_step = before - model.head.weight
    assert grad_free_step.abs().max() > 0  # the loaded lr is the one used in backward


def test_load_rejects_a_state_dict_of_another_shape():
    opt = InBackwardOptimizer(make_model().parameters(), optim.SGD, lr=0.1)
    other = optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="parameter group that doesn't match the size"):
        opt.load_state_dict(other.state_dict())


# ---- the three examples of the torch.optim documentation ("How to utilize named parameters to load an optimizer
# state dict"), run as written with InBackwardOptimizer in place of optim.SGD, and compared with optim.SGD.
# The documentation's second example registers `adapt_state_dict_ids` where it means
# `adapt_state_dict_missing_param` (the hook it has just defined); we register the one it defines.

class OneLayerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x)


class TwoLayerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(3, 4)

    def forward(self, x):
        return (self.fc1(x) + self.fc2(x)) / 2


def adapt_state_dict_ids(optimizer, state_dict):
    adapted_state_dict = copy.deepcopy(optimizer.state_dict())
    # Copy setup parameters (lr, weight_decay, etc.), in case they differ in the loaded state dict.
    for k, v in state_dict["param_groups"][0].items():
        if k not in ["params", "param_names"]:
            adapted_state_dict["param_groups"][0][k] = v

    lookup_dict = {"fc1.weight": "fc.weight", "fc1.bias": "fc.bias", "fc2.weight": "fc.weight", "fc2.bias": "fc.bias"}
    clone_deepcopy = lambda d: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in d.items()}  # noqa: E731,E501
    for param_id, param_name in zip(
        optimizer.state_dict()["param_groups"][0]["params"], optimizer.state_dict()["param_groups"][0]["param_names"]
    ):
        name_in_loaded = lookup_dict[param_name]
        index_in_loaded_list = state_dict["param_groups"][0]["param_names"].index(name_in_loaded)
        id_in_loaded = state_dict["param_groups"][0]["params"][index_in_loaded_list]
        # Copy the state of the corresponding parameter
        if id_in_loaded in state_dict["state"]:
            adapted_state_dict["state"][param_id] = clone_deepcopy(state_dict["state"][id_in_loaded])

    return adapted_state_dict


class Model1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return self.fc(x) + x


class Model_bypass(nn.Module):  # noqa: N801 (the documentation's name)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.bypass = nn.Linear(5, 5, bias=False)
        torch.nn.init.eye_(self.bypass.weight)

    def forward(self, x):
        return self.fc(x) + self.bypass(x)


def adapt_state_dict_missing_param(optimizer, state_dict):
    adapted_state_dict = copy.deepcopy(optimizer.state_dict())
    # Copy setup parameters (lr, weight_decay, etc.), in case they differ in the loaded state dict.
    for k, v in state_dict["param_groups"][0].items():
        if k not in ["params", "param_names"]:
            adapted_state_dict["param_groups"][0][k] = v

    lookup_dict = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", "bypass.weight": None}

    clone_deepcopy = lambda d: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in d.items()}  # noqa: E731,E501
    for param_id, param_name in zip(
        optimizer.state_dict()["param_groups"][0]["params"], optimizer.state_dict()["param_groups"][0]["param_names"]
    ):
        name_in_loaded = lookup_dict[param_name]
        if name_in_loaded in state_dict["param_groups"][0]["param_names"]:
            index_in_loaded_list = state_dict["param_groups"][0]["param_names"].index(name_in_loaded)
            id_in_loaded = state_dict["param_groups"][0]["params"][index_in_loaded_list]
            # Copy the state of the corresponding parameter
            if id_in_loaded in state_dict["state"]:
                adapted_state_dict["state"][param_id] = clone_deepcopy(state_dict["state"][id_in_loaded])

    return adapted_state_dict


def names_matching(optimizer, state_dict):
    assert len(state_dict["param_groups"]) == len(optimizer.state_dict()["param_groups"])
    adapted_state_dict = copy.deepcopy(optimizer.state_dict())
    for g_ind in range(len(state_dict["param_groups"])):
        assert len(state_dict["param_groups"][g_ind]["params"]) == len(
            optimizer.state_dict()["param_groups"][g_ind]["params"]
        )

        for k, v in state_dict["param_groups"][g_ind].items():
            if k not in ["params", "param_names"]:
                adapted_state_dict["param_groups"][g_ind][k] = v

        for param_id, param_name in zip(
            optimizer.state_dict()["param_groups"][g_ind]["params"],
            optimizer.state_dict()["param_groups"][g_ind]["param_names"],
        ):
            index_in_loaded_list = state_dict["param_groups"][g_ind]["param_names"].index(param_name)
            id_in_loaded = state_dict["param_groups"][g_ind]["params"][index_in_loaded_list]
            # Copy the state of the corresponding parameter
            if id_in_loaded in state_dict["state"]:
                adapted_state_dict["state"][param_id] = copy.deepcopy(state_dict["state"][id_in_loaded])

    return adapted_state_dict


def _train(model, opt, in_backward, steps, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, in_features, generator=g)).square().mean().backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()


def _saved_state(model_cls, in_features):
    """Train the documentation's first model with optim.SGD, as the documentation does, and save its state."""
    torch.manual_seed(0)
    model = model_cls()
    optimizer = optim.SGD(model.named_parameters(), lr=0.01, momentum=0.9)
    _train(model, optimizer, False, 2, in_features, seed=1)
    return roundtrip(optimizer.state_dict())


def _resume(model2_cls, hook, saved, in_features, named=lambda m: m.named_parameters()):
    """The same new model twice: one with optim.SGD, one with InBackwardOptimizer, both loading through ``hook``."""
    out = []
    for in_backward in (False, True):
        torch.manual_seed(2)
        model2 = model2_cls()
        if in_backward:  # its default implementation for SGD is foreach (see dist_optim.optimizer._implementation)
            optimizer2 = InBackwardOptimizer(named(model2), optim.SGD, lr=0.01, momentum=0.9)
        else:
            optimizer2 = optim.SGD(named(model2), lr=0.01, momentum=0.9, foreach=True)
        optimizer2.register_load_state_dict_pre_hook(hook)
        optimizer2.load_state_dict(saved)
        loaded = copy.deepcopy(optimizer2.state_dict())
        _train(model2, optimizer2, in_backward, 3, in_features, seed=3)
        out.append((model2, loaded, optimizer2.state_dict()))
    return out


def test_doc_example_duplicates_one_layer_state_into_two_experts():
    saved = _saved_state(OneLayerModel, 3)
    (ref, ref_loaded, ref_final), (model, loaded, final) = _resume(TwoLayerModel, adapt_state_dict_ids, saved, 3)
    assert_same_state(loaded, ref_loaded)
    fc_momentum = saved["state"][0]["momentum_buffer"]
    assert torch.equal(loaded["state"][0]["momentum_buffer"], fc_momentum)  # fc1.weight <- fc.weight
    assert torch.equal(loaded["state"][2]["momentum_buffer"], fc_momentum)  # fc2.weight <- fc.weight
    assert_same_params(model, ref)
    assert_same_state(final, ref_final)


def test_doc_example_new_layer_starts_fresh():
    saved = _saved_state(Model1, 5)
    (ref, ref_loaded, ref_final), (model, loaded, final) = _resume(
        Model_bypass, adapt_state_dict_missing_param, saved, 5
    )
    assert_same_state(loaded, ref_loaded)
    assert sorted(loaded["state"]) == [0, 1]  # fc.weight and fc.bias resumed; bypass.weight has no state yet
    assert_same_params(model, ref)
    assert_same_state(final, ref_final)


def test_doc_example_loads_by_names_in_another_order():
    saved = _saved_state(OneLayerModel, 3)
    reverse = lambda m: list(m.named_parameters())[::-1]  # noqa: E731
    (ref, ref_loaded, ref_final), (model, loaded, final) = _resume(OneLayerModel, names_matching, saved, 3, reverse)
    assert_same_state(loaded, ref_loaded)
    assert loaded["param_groups"][0]["param_names"] == ["fc.bias", "fc.weight"]
    assert torch.equal(loaded["state"][0]["momentum_buffer"], saved["state"][1]["momentum_buffer"])
    assert_same_params(model, ref)
    assert_same_state(final, ref_final)

"""InBackwardOptimizer in place of the optimizer in checks written for torch's own optimizers (test_optim's style).

Each behaviour is compared with the wrapped class used in the standard loop: old checkpoints whose ``step`` is a
plain number, sparse gradients that reach ``step()`` with the default implementation, and param groups that mix
named and unnamed parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    assert_same_params,
    batches,
    loss_of,
    make_model,
    train_in_backward,
    train_standard,
    twins,
)
from torch import nn

from dist_optim import InBackwardOptimizer

# foreach on both sides: the same kernel, so the comparison is bitwise
NONTENSOR_STEP = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}


def _as_old_checkpoint(sd: dict) -> dict:
    """What older torch versions wrote: ``step`` (and ASGD's ``eta``, ``mu``) as plain numbers."""
    sd = copy.deepcopy(sd)
    for state in sd["state"].values():
        for key in ("step", "eta", "mu"):
            if key in state:
                state[key] = state[key].item()
    return sd


@pytest.mark.parametrize("name", list(NONTENSOR_STEP))
def test_load_nontensor_step(name):
    cls, kwargs = NONTENSOR_STEP[name]
    data = batches(4)
    model, ref = twins()
    opt = InBackwardOptimizer(model.named_parameters(), cls, foreach=True, **kwargs)
    ref_opt = cls(ref.named_parameters(), foreach=True, **kwargs)
    train_in_backward(model, data[:2])
    train_standard(ref, ref_opt, data[:2])
    old, ref_old = _as_old_checkpoint(opt.state_dict()), _as_old_checkpoint(ref_opt.state_dict())
    assert isinstance(old["state"][0]["step"], float)

    resumed, ref_resumed = copy.deepcopy(model), copy.deepcopy(ref)
    opt.remove()
    opt = InBackwardOptimizer(resumed.named_parameters(), cls, foreach=True, **kwargs)
    ref_opt = cls(ref_resumed.named_parameters(), foreach=True, **kwargs)
    opt.load_state_dict(old)
    ref_opt.load_state_dict(ref_old)
    assert all(torch.is_tensor(s["step"]) for s in opt.state.values())
    train_in_backward(resumed, data[2:])
    train_standard(ref_resumed, ref_opt, data[2:])
    assert_same_params(resumed, ref_resumed)
    for p, q in zip(resumed.parameters(), ref_resumed.parameters()):
        assert torch.equal(opt.state[p]["step"], ref_opt.state[q]["step"])


def test_load_nontensor_step_with_the_default_implementation():
    data = batches(4)
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)  # fused on CPU
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train_in_backward(model, data[:2])
    train_standard(ref, ref_opt, data[:2])
    opt.load_state_dict(_as_old_checkpoint(opt.state_dict()))
    ref_opt.load_state_dict(_as_old_checkpoint(ref_opt.state_dict()))
    train_in_backward(model, data[2:])
    train_standard(ref, ref_opt, data[2:])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused vs for-loop: last bits only
        assert torch.equal(opt.state[p]["step"], ref_opt.state[q]["step"])


def _embedding_model(dense: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Embedding(12, 4, sparse=True)] + ([nn.Linear(4, 1)] if dense else [])
    return nn.Sequential(*layers)


def _sparse_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 12, (5,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("how", ["grad set by hand", "after remove()"])
def test_sparse_gradient_at_step_with_the_default_implementation(how):
    model = _embedding_model(dense=False)
    ref = copy.deepcopy(model)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.Adagrad, lr=0.1)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    if how == "after remove()":
        opt.remove()
    for idx in _sparse_batches(3):
        if how == "grad set by hand":  # the gradient never passed through a backward the optimizer saw
            ref(idx).square().sum().backward()
            model[0].weight.grad = ref[0].weight.grad.clone()
        else:
            model(idx).square().sum().backward()
            ref(idx).square().sum().backward()
        assert model[0].weight.grad.is_sparse
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_params(model, ref)  # both sides take Adagrad's for-loop, the one path for sparse gradients


def test_sparse_and_dense_gradients_at_one_step():
    model = _embedding_model(dense=True)
    ref = copy.deepcopy(model)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.Adagrad, lr=0.1)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt.remove()
    for k, idx in enumerate(_sparse_batches(3)):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(idx).square().sum().backward()
            o.step()
            o.zero_grad()
        if k == 0:  # same gradients, same for-loop on the sparse part
            assert torch.equal(model[0].weight, ref[0].weight)
    for p, q in zip(model.parameters(), ref.parameters()):
        # fused vs for-loop Adagrad on the dense part, whose last bits reach the embedding's later gradients
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("named_first", [True, False])
def test_mixed_named_and_unnamed_groups_are_refused_like_torch(named_first):
    model = make_model()
    named = {"params": list(model.layers.named_parameters())}
    unnamed = {"params": list(model.head.parameters())}
    groups = [named, unnamed] if named_first else [unnamed, named]
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW(copy.deepcopy(groups), lr=1e-2)
    with pytest.raises(ValueError) as ours:
        InBackwardOptimizer(groups, torch.optim.AdamW, lr=1e-2)
    assert str(ours.value).startswith(str(theirs.value))
    # nothing stays attached: the model trains with a new optimizer
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    loss_of(model, batches(1)[0]).backward()
    assert opt.state and all(p.grad is None for p in model.parameters())


def test_add_param_group_refuses_the_other_kind_like_torch():
    model = make_model()
    opt = InBackwardOptimizer(model.layers.named_parameters(), torch.optim.SGD, lr=0.1)
    ref = torch.optim.SGD(make_model().layers.named_parameters(), lr=0.1)
    with pytest.raises(ValueError) as theirs:
        ref.add_param_group({"params": list(make_model().head.parameters())})
    with pytest.raises(ValueError) as ours:
        opt.add_param_group({"params": list(model.head.parameters())})
    assert str(ours.value).startswith(str(theirs.value))
    assert len(opt.param_groups) == 1

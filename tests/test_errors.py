"""Bad input is refused at construction, with an error that names the value and the fix."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_params, batches, loss_of, make_model, train_standard
from torch import nn

from dist_optim import InBackwardOptimizer, apply_optimizer_in_backward


def test_optimizer_needing_a_closure_is_refused():
    with pytest.raises(ValueError, match="LBFGS needs a closure"):
        InBackwardOptimizer(make_model().parameters(), torch.optim.LBFGS)


def test_an_optimizer_instance_is_refused_with_the_fix():
    model = make_model()
    with pytest.raises(TypeError, match=r"got an instance of AdamW; pass the class and its options"):
        InBackwardOptimizer(model.parameters(), torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("bad", ["adamw", nn.Linear, None])
def test_something_not_an_optimizer_class_is_refused(bad):
    with pytest.raises(TypeError, match="must be a subclass of torch.optim.Optimizer"):
        InBackwardOptimizer(make_model().parameters(), bad)


def test_unknown_option_surfaces_the_optimizers_own_error_at_construction():
    with pytest.raises(TypeError, match="unexpected keyword argument 'betas'"):
        InBackwardOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1, betas=(0.9, 0.99))


def test_invalid_option_value_surfaces_at_construction():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        InBackwardOptimizer(make_model().parameters(), torch.optim.AdamW, lr=-1.0)


@pytest.mark.parametrize(("kwargs", "error"), [
    (dict(lr=0.1, betas=(0.9, 0.99)), TypeError),  # the class's own options check
    (dict(lr=-1.0), ValueError),
    (dict(lr=0.1, bucket_cap_mb=0), ValueError),  # the engine's
])
def test_a_construction_the_options_fail_attaches_nothing(kwargs, error):
    model, ref = make_model(), make_model()
    with pytest.raises(error):
        InBackwardOptimizer(model.parameters(), torch.optim.SGD, **kwargs)
    # no hook stayed: the same parameters train in a standard loop as if nothing had been tried, then in backward
    data = batches(2)
    train_standard(model, torch.optim.SGD(model.parameters(), lr=0.1), data[:1])
    train_standard(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data[:1])
    assert_same_params(model, ref)
    InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    loss_of(model, data[1]).backward()
    assert all(p.grad is None for p in model.parameters()) and not torch.equal(model.head.weight, ref.head.weight)


def test_group_specific_refusal_surfaces_at_construction():
    model = make_model()
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        InBackwardOptimizer(
            [{"params": [model.head.bias], "optimizer_class": torch.optim.Muon}], torch.optim.AdamW
        )


def test_non_leaf_tensor_is_refused():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"can't optimize a non-leaf Tensor \(param_groups\[0\]\[0\]\)"):
        InBackwardOptimizer([w * 2], torch.optim.SGD, lr=0.1)


def test_tensor_not_requiring_grad_is_refused_by_name():
    model = make_model()
    model.head.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"head.bias does not require grad.*pass the nn.Module, which skips them"):
        InBackwardOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)


def test_same_parameter_twice_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="appears in more than one place"):
        InBackwardOptimizer([{"params": [model.head.weight]}, {"params": [model.head.weight]}], torch.optim.SGD, lr=1)
    with pytest.raises(ValueError, match="appears in more than one place"):
        InBackwardOptimizer([model.head.weight, model.head.weight], torch.optim.SGD, lr=1)


def test_a_failed_construction_attaches_nothing():
    model = make_model()
    with pytest.raises(ValueError):
        InBackwardOptimizer([{"params": [model.head.weight]}, {"params": [model.head.weight]}], torch.optim.SGD, lr=1)
    model(torch.randn(2, 8)).sum().backward()
    assert model.head.weight.grad is not None  # no hook of the failed optimizer consumed it


@pytest.mark.parametrize("cap", [0, -1.0, "16"])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ValueError, match=f"bucket_cap_mb must be > 0, got {cap!r}"):
        InBackwardOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=cap)


def test_empty_inputs_are_refused():
    with pytest.raises(ValueError, match="empty parameter list"):
        InBackwardOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty 'params' list"):
        InBackwardOptimizer([{"params": []}], torch.optim.SGD, lr=0.1)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Linear has no parameter that requires grad"):
        InBackwardOptimizer(frozen, torch.optim.SGD, lr=0.1)


def test_a_bare_tensor_or_a_set_is_refused():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="got a Tensor; wrap it in a list"):
        InBackwardOptimizer(w, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="ordered collections"):
        InBackwardOptimizer([{"params": {w}}], torch.optim.SGD, lr=0.1)


def test_sparse_embedding_with_a_dense_only_optimizer_is_refused():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"0 makes sparse gradients .* which Adam cannot step; use torch.optim.Sparse"):
        InBackwardOptimizer(model, torch.optim.Adam)


def test_sparse_gradients_step_like_the_standard_loop():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)  # embedding: for-loop; linear: foreach
    # the reference runs the kernels the engine picks, per parameter: bitwise needs the same kernel on both sides
    ref_opt = torch.optim.SGD([{"params": ref[0].parameters(), "foreach": False},
                               {"params": ref[1].parameters(), "foreach": True}], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(0, 10, (6,), generator=g)
        model(idx).square().mean().backward()
        ref(idx).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt.state[model[0].weight]["momentum_buffer"] is not None


def test_seed_pair_refuses_bad_input_too():
    model = make_model()
    with pytest.raises(ValueError, match="LBFGS needs a closure"):
        apply_optimizer_in_backward(torch.optim.LBFGS, model.parameters(), {})
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        apply_optimizer_in_backward(torch.optim.SGD, [model.head.weight * 1], {"lr": 0.1})


def test_a_ddp_comm_hook_without_a_ddp_model_is_refused():
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="ddp_comm_hook is given but params is not a DistributedDataParallel"):
        InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, ddp_comm_hook=lambda state, bucket: None)
    assert all(getattr(p, "_in_backward_engine", None) is None for p in model.parameters())

"""``InBackwardOptions``: the engine options as one frozen object, checked once, given as keywords or as one object."""

import dataclasses

import pytest
import torch

import dist_optim
from dist_optim import InBackwardOptimizer, InBackwardOptions


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(opt_of, steps=3):
    model = _model()
    opt = opt_of(model)
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("bad, match", [
    (dict(bucket_cap_mb=0), "bucket_cap_mb must be > 0"),
    (dict(bucket_cap_mb=True), "bucket_cap_mb must be > 0"),
    (dict(accumulation_steps=0), "accumulation_steps must be an int >= 1"),
    (dict(accumulation_steps=2.0), "accumulation_steps must be an int >= 1"),
    (dict(max_grad_norm=-1.0), "max_grad_norm must be a number > 0"),
    (dict(max_grad_value=0), "max_grad_value must be a number > 0"),
    (dict(clip_mode="global"), "clip_mode must be one of"),
    (dict(overflow="some"), "overflow must be one of"),
    (dict(nonfinite="warn"), "nonfinite must be one of"),
    (dict(grad_norm_type=0), r"grad_norm_type must be > 0"),
    (dict(grad_norm_type="two"), r"grad_norm_type must be a number"),
    (dict(grad_multiplier=float("nan")), "grad_multiplier must be a finite number"),
    (dict(grad_multiplier=torch.ones(2)), "one-element floating tensor"),
    (dict(grad_divisor=0), "grad_divisor must be an int >= 1"),
])
def test_each_option_is_checked_where_the_object_is_built_and_named(bad, match):
    with pytest.raises(ValueError, match=match):
        InBackwardOptions(**bad)
    with pytest.raises(ValueError, match=match):  # a copy is checked again
        dataclasses.replace(InBackwardOptions(), **bad)


def test_a_grad_scaler_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler, got object"):
        InBackwardOptions(grad_scaler=object())


def test_options_are_frozen_and_normalised():
    options = InBackwardOptions(grad_norm_type=2, grad_multiplier=2)
    assert options.grad_norm_type == 2.0 and isinstance(options.grad_norm_type, float)
    assert options.grad_multiplier == 2.0 and isinstance(options.grad_multiplier, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.clip_mode = "two_pass"
    assert InBackwardOptions(bucket_cap_mb=float("inf")).cap_bytes > 2**40
    assert InBackwardOptions(bucket_cap_mb=1.5).cap_bytes == int(1.5 * 2**20)


def test_options_object_trains_bitwise_as_the_same_keywords():
    keywords = dict(bucket_cap_mb=0.0001, max_grad_norm=0.05, track_grad_norm=True)
    by_keywords, a = _train(lambda m: InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-2, **keywords))
    by_object, b = _train(lambda m: InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-2,
                                                          options=InBackwardOptions(**keywords)))
    assert all(torch.equal(x, y) for x, y in zip(by_keywords, by_object))
    assert a.options == b.options == InBackwardOptions(**keywords)
    assert b.max_grad_norm == 0.05 and b.options.bucket_cap_mb == 0.0001
    assert len(b.buckets) > 1  # the cap reached the engine


def test_options_and_an_engine_keyword_together_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match="options= and the engine keyword.s. max_grad_norm, strict"):
        InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=1.0, strict=True,
                            options=InBackwardOptions())
    with pytest.raises(TypeError, match="options must be a dist_optim.InBackwardOptions, got dict"):
        InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, options={"max_grad_norm": 1.0})
    assert all(p.grad is None for p in model.parameters())
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)  # nothing was left attached by the refusals
    assert opt.options == InBackwardOptions()


def test_configure_clipping_returns_the_checked_copy_and_a_refused_change_changes_nothing():
    model = _model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=1.0)
    before = opt.options
    new = opt.configure_clipping(clip_mode="two_pass", grad_norm_order=model)
    assert new is opt.options and new == dataclasses.replace(before, clip_mode="two_pass") and before.clip_mode == "exact"
    order = opt.grad_norm_order
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        opt.configure_clipping(clip_mode="nope", grad_norm_order=None)
    with pytest.raises(TypeError, match="grad_norm_order must be an ordered iterable"):
        opt.configure_clipping(max_grad_norm=2.0, grad_norm_order={model[0].weight})
    assert opt.options is new and opt.grad_norm_order == order  # neither change landed


def test_set_grad_multiplier_replaces_the_options_with_a_checked_copy():
    opt = InBackwardOptimizer(_model(), torch.optim.SGD, lr=0.1)
    opt.set_grad_multiplier(0.5)
    assert opt.options.grad_multiplier == 0.5 == opt.grad_multiplier
    with pytest.raises(ValueError, match="grad_multiplier must be a finite number"):
        opt.set_grad_multiplier(float("inf"))
    assert opt.grad_multiplier == 0.5


def test_the_class_factory_takes_an_options_object():
    options = InBackwardOptions(per_parameter=True)
    cls = dist_optim.in_backward(torch.optim.SGD, options=options)
    model = _model()
    opt = cls(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    assert opt.options is options and len(opt.buckets) == 4

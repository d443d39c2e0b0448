"""The engine's guards: what a user without an adapter can get wrong is said, or refused, never silent."""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
from helpers import assert_same_params, batches, loss_of, make_model, train_standard
from torch import nn

from dist_optim import InBackwardOptimizer

LAYER_BYTES = (8 * 8 + 8) * 4  # one hidden Linear's gradients, float32


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- a. several stepping backwards between two step() calls ---------------------------------------------------
def _framework_loop(model, opt, data, k):
    """What HF Trainer, accelerate or Lightning do with gradient accumulation: k backwards, then step()."""
    for start in range(0, len(data), k):
        for batch in data[start:start + k]:
            (loss_of(model, batch) / k).backward()
        opt.step()
        opt.zero_grad()


def test_accumulation_written_for_a_standard_optimizer_is_reported_once():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.warns(UserWarning, match=r"3 backwards each ran a full optimizer step.*made 3 optimizer steps "
                                         r"instead of one.*accumulation_steps=3.*opt.no_step\(\).*integrations"):
        _framework_loop(model, opt, batches(3), 3)
    with _no_warnings():
        _framework_loop(model, opt, batches(3, seed=2), 3)  # once per optimizer


def test_strict_raises_and_the_right_setting_is_silent_and_equal_to_the_standard_loop():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, strict=True)
    for seed in (1, 2):  # at every such step(), not only the first (a warning is said once)
        with pytest.raises(RuntimeError, match=r"2 backwards each ran.*accumulation_steps=2.*\(strict=True\)"):
            _framework_loop(model, opt, batches(2, seed=seed), 2)
    model, ref = make_model(), make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, accumulation_steps=2, strict=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    data = batches(4)
    with _no_warnings():
        _framework_loop(model, opt, data, 2)
    _framework_loop(ref, ref_opt, data, 2)
    assert_same_params(model, ref)


def test_a_loop_that_steps_each_backward_and_calls_step_is_silent():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, strict=True)
    _framework_loop(model, opt, batches(3), 1)
    # accumulation_steps > 1 flushed by step() at the end of an epoch, or no_step() on the micro-batches: meant
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, accumulation_steps=2, strict=True)
    _framework_loop(model, opt, batches(5), 5)
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, strict=True)
    for batch in batches(3):
        with opt.no_step():
            loss_of(model, batch).backward()
        loss_of(model, batch).backward()
    opt.step()


# -- 3 and 4. a backward that raises ----------------------------------------------------------------------------
def _failing_backward(model, batch):
    """A backward that raises once the head and the last layers' gradients are in, before the first layer's."""

    def boom(_grad):
        raise RuntimeError("boom")

    x, y = batch
    h = torch.tanh(model.layers[0](x))
    h.register_hook(boom)
    out = model.head(model.norm(torch.tanh(model.layers[2](torch.tanh(model.layers[1](h))))))
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.mse_loss(out, y).backward()


# buckets near the head stepped and the next one partial / one bucket, nothing stepped
@pytest.mark.parametrize("cap", [600 / 2**20, 1.0])
def test_stale_gradients_of_a_failed_backward_are_dropped_not_stepped(cap):
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, bucket_cap_mb=cap)
    data = batches(3)
    loss_of(model, data[0]).backward()
    assert not opt.step_incomplete
    before = [p.detach().clone() for p in model.parameters()]
    _failing_backward(model, data[1])
    stepped = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    stale = [p.grad is not None for p in model.parameters()]
    assert any(stale) and opt.step_incomplete == any(stepped)
    # The reference: a standard SGD over the same state, stepping on the next batch's gradients alone.
    ref = make_model()  # not a deepcopy, which would copy the parameters' hooks
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its momentum buffers are the optimizer's own
    train_standard(ref, ref_opt, data[2:])
    expected = (f"{sum(stepped)} tensors had already been stepped.*step_incomplete is True.*reload the last "
                f"checkpoint.*" if any(stepped) else "") + rf"\b{sum(stale)} tensors' gradients left from it"
    with pytest.warns(RuntimeWarning, match=rf"previous backward did not finish.*{expected}.*were dropped"):
        loss_of(model, data[2]).backward()
    assert not opt.step_incomplete
    if stale[-1]:  # the head's gradient arrives first: it held this backward's part too, and was dropped
        assert torch.equal(model.head.bias, before[-1])
        ref.head.bias.data.copy_(before[-1])
    assert_same_params(model, ref)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_a_failed_backward_lets_the_next_one_step_all_its_gradients(set_to_none):
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, bucket_cap_mb=1.0)
    data = batches(3)
    loss_of(model, data[0]).backward()
    _failing_backward(model, data[1])  # one bucket: nothing stepped, gradients left in .grad
    assert not opt.step_incomplete and any(p.grad is not None for p in model.parameters())
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.zero_grad(set_to_none=set_to_none)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stale is left to drop, so nothing is said
        loss_of(model, data[2]).backward()
    train_standard(ref, ref_opt, data[2:])
    assert_same_params(model, ref)  # every tensor stepped, the first one's gradient included


@pytest.mark.parametrize("how", ["no_step", "accumulation_steps"])
def test_a_micro_batch_that_only_accumulates_and_raises_keeps_its_partial_grad_as_the_standard_loop(how):
    model, ref = make_model(), make_model()
    kwargs = {"accumulation_steps": 2} if how == "accumulation_steps" else {}
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, **kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    data = batches(2)
    for m in (model, ref):
        with opt.no_step() if m is model and how == "no_step" else contextlib.nullcontext():
            _failing_backward(m, data[0])  # the head's and the last layers' gradients arrived, not the first's
    assert [p.grad is not None for p in model.parameters()] == [p.grad is not None for p in ref.parameters()]
    assert any(p.grad is not None for p in model.parameters()) and not opt.step_incomplete
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped: an accumulating micro-batch keeps what it got
        loss_of(model, data[1]).backward()
    loss_of(ref, data[1]).backward()
    ref_opt.step()
    assert_same_params(model, ref)


def test_step_incomplete_is_true_while_buckets_are_being_stepped():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, per_parameter=True)
    seen = []
    opt.register_bucket_step_hook(lambda o, params: seen.append(o.step_incomplete))
    loss_of(model, batches(1)[0]).backward()
    assert seen and all(seen) and not opt.step_incomplete
    with pytest.raises(AttributeError):
        opt.step_incomplete = False


# -- 8. a parameter unfrozen after construction ----------------------------------------------------------------
def test_a_parameter_unfrozen_after_construction_is_named_once():
    model = make_model()
    model.layers[0].weight.requires_grad_(False)
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)
    loss_of(model, batches(1)[0]).backward()  # still frozen: nothing to say
    model.layers[0].weight.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"parameter layers.0.weight got a gradient but no optimizer steps it"):
        loss_of(model, batches(1)[0]).backward()
    with _no_warnings():
        loss_of(model, batches(1)[0]).backward()
    # Once given to an optimizer, it trains.
    opt.add_param_group({"params": [("layers.0.weight", model.layers[0].weight)]})  # named, like the groups it joins
    model.layers[0].weight.grad = None
    before = model.layers[0].weight.detach().clone()
    loss_of(model, batches(1)[0]).backward()
    assert not torch.equal(model.layers[0].weight, before) and model.layers[0].weight.grad is None


# -- 9 and 17. refused input, accepted infinity -----------------------------------------------------------------
def test_meta_parameters_are_refused_by_name():
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match=r"layers.0.weight is on the meta device.*after materialising"):
        InBackwardOptimizer(model, torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[0\] is on the meta device"):
        InBackwardOptimizer(model.parameters(), torch.optim.AdamW)


def test_a_set_of_parameters_is_refused_like_torch():
    model = make_model()
    with pytest.raises(TypeError, match="got a set"):
        InBackwardOptimizer(set(model.parameters()), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="ordered collections"):
        InBackwardOptimizer([{"params": set(model.parameters())}], torch.optim.SGD, lr=0.1)


def _equal_to_fused_adamw(**options):
    """Three in-backward AdamW steps with ``options`` equal the fused standard loop's; returns (model, optimizer)."""
    model, ref = make_model(), make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    data = batches(3)
    for batch in data:
        loss_of(model, batch).backward()
    train_standard(ref, ref_opt, data)
    assert_same_params(model, ref)
    return model, opt


def test_an_infinite_bucket_cap_is_one_bucket_equal_to_the_standard_loop():
    model, opt = _equal_to_fused_adamw(bucket_cap_mb=math.inf)
    assert len(opt.buckets) == 1 and len(opt.buckets[0]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got nan"):
        InBackwardOptimizer(make_model().parameters(), torch.optim.AdamW, bucket_cap_mb=math.nan)


# -- c. gradient bytes held --------------------------------------------------------------------------------------
def test_grad_bytes_peak_counts_what_buckets_hold():
    model = make_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    one = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=math.inf)
    loss_of(model, batches(1)[0]).backward()
    assert one.last_step.grad_bytes_peak == total
    one.remove()
    small = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=LAYER_BYTES / 2**20)
    for batch in batches(2):
        loss_of(model, batch).backward()
        assert 0 < small.last_step.grad_bytes_peak <= 2 * LAYER_BYTES < total
    small.remove()
    exact = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=LAYER_BYTES / 2**20,
                                max_grad_norm=1.0)
    loss_of(model, batches(1)[0]).backward()
    assert exact.last_step.grad_bytes_peak == total  # exact clipping holds every gradient until backward ends


# -- s. the CUDA stream rule is not reached on CPU ----------------------------------------------------------------
def test_the_stream_rule_is_a_no_op_on_cpu(monkeypatch):
    def no_streams_on_cpu():
        raise AssertionError("torch.cuda.current_stream() called for CPU gradients")

    monkeypatch.setattr(torch.cuda, "current_stream", no_streams_on_cpu)
    model, opt = _equal_to_fused_adamw(bucket_cap_mb=LAYER_BYTES / 2**20)
    assert len(opt.buckets) > 1 and all(p.grad is None for p in model.parameters())


# -- b. compiled autograd --------------------------------------------------------------------------------------------
def test_compiled_autograd_is_refused_before_anything_steps_and_leaves_no_stale_gradient():
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo import compiled_autograd

    model, ref = make_model(), make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    data = batches(2)
    before = [p.detach().clone() for p in model.parameters()]
    with (
        pytest.raises(RuntimeError, match=r"compiled autograd is on.*_enable.*Turn compiled autograd off"),
        compiled_autograd._enable(torch.compile(backend="eager")),
    ):
        loss_of(model, data[0]).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.step_incomplete
    # The refused backward's gradient went with it: the next (eager) backward steps on its own gradients, all of them.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_of(model, data[1]).backward()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    train_standard(ref, ref_opt, data[1:])
    assert_same_params(model, ref)
    with (
        dynamo.config.patch(compiled_autograd=True),
        pytest.raises(RuntimeError, match=r"compiled autograd is on \(torch._dynamo.config.compiled_autograd"),
    ):
        InBackwardOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1)


class _TwoHeads(nn.Module):
    """A multi-task model: one trunk, two heads, a loss each."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.a(h).square().mean(), self.b(h).abs().mean()


@pytest.mark.parametrize("cap", [float("inf"), 1e-4])
def test_a_second_loss_over_a_graph_kept_by_a_stepping_backward_is_refused_by_name(cap):
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = InBackwardOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=cap)
    l1, l2 = model(torch.randn(5, 4))
    l1.backward(retain_graph=True)  # steps every parameter l1 reaches
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"ran again over a graph kept with retain_graph=True.*add them and run one "
                                           r"backward \(\(loss1 \+ loss2\)\.backward\(\)"):
        l2.backward()
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))  # nothing stepped a second time
    assert all(p.grad is None for p in model.parameters()) and not opt.step_incomplete


def test_the_sum_of_the_losses_is_the_standard_loops_step_and_retain_graph_alone_is_silent():
    torch.manual_seed(0)
    model = _TwoHeads()
    ref = copy.deepcopy(model)
    opt = InBackwardOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)  # the kernel the optimizer picks
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        sum(ref(x)).backward()  # one backward of the summed losses: the fix the refusal names
        ref_opt.step()
        ref_opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sum(model(x)).backward(retain_graph=True)  # a graph kept and never used again: no error, no warning
        assert opt.last_step.params_stepped == 6
    assert_same_params(model, ref)

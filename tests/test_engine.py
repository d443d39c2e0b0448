"""The engine: buckets, freeing, unused and tied parameters, failed backwards, and nothing kept alive."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from helpers import (
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    train_standard,
    twins,
)
from torch import nn

from dist_optim import InBackwardOptimizer


def test_buckets_follow_gradient_arrival_and_cap():
    model = make_model(width=16)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=16 * 16 * 4 / 2**20)
    loss_of(model, batches(1, width=16)[0]).backward()
    buckets = opt.buckets
    flat = [p for b in buckets for p in b]
    assert len(flat) == len(list(model.parameters()))
    assert flat[0] is model.head.bias or flat[0] is model.head.weight  # the head's gradients arrive first
    position = {id(p): k for k, p in enumerate(flat)}
    assert position[id(model.layers[0].weight)] > position[id(model.layers[2].weight)]
    cap = 16 * 16 * 4
    # tensors one autograd node computes together (a module's: a Linear's bias and weight come from one addmm
    # backward, a LayerNorm's from one layer-norm backward) stay in one bucket, even over the cap
    module_of = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    computed_together = {i: sum(q.numel() * q.element_size() for q in m.parameters(recurse=False))
                         for i, m in module_of.items()}
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in buckets]
    # a bucket holds no more than the cap, but for one module's tensors together
    assert all(size <= cap or len({id(module_of[id(p)]) for p in b}) == 1 for size, b in zip(sizes, buckets))
    # and closes only when the next gradient would not fit, with those computed together with it
    for b, nxt in zip(buckets, buckets[1:]):
        assert sum(p.numel() * p.element_size() for p in b) + computed_together[id(nxt[0])] > cap
    assert len(buckets) > 2


def test_a_tensor_larger_than_the_cap_is_a_bucket_of_its_own():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=1000 / 2**20)
    model(torch.randn(3, 64)).sum().backward()
    big = [b for b in opt.buckets if any(p is model[0].weight for p in b)]
    assert len(big) == 1 and {id(p) for p in big[0]} == {id(model[0].weight), id(model[0].bias)}  # with its bias


def test_per_parameter_mode_steps_each_parameter_alone():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, per_parameter=True)
    loss_of(model, batches(1)[0]).backward()
    assert [len(b) for b in opt.buckets] == [1] * len(list(model.parameters()))


def test_gradients_are_freed_while_backward_runs():
    """When the first layer's gradient is ready, the head was already stepped and its gradient freed."""
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, per_parameter=True)
    head_before = model.head.weight.detach().clone()
    seen = {}

    def probe(_p):
        seen["head_grad"] = model.head.weight.grad
        seen["head_changed"] = not torch.equal(model.head.weight, head_before)

    model.layers[0].weight.register_post_accumulate_grad_hook(probe)
    loss_of(model, batches(1)[0]).backward()
    assert seen == {"head_grad": None, "head_changed": True}
    assert opt is not None


@pytest.mark.parametrize("cap", [16.0, 1e-4])
def test_unused_parameters_are_not_stepped(cap):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.a = nn.Linear(8, 1)
            self.b = nn.Linear(8, 1)

        def forward(self, x, head):
            return getattr(self, head)(torch.tanh(self.body(x)))

    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=cap, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    heads = ["a", "a", "b", "a", "b"]  # b is unused on the first backward, when buckets are learned
    for (x, y), head in zip(batches(5), heads):
        nn.functional.mse_loss(model(x, head), y).backward()
        nn.functional.mse_loss(ref(x, head), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert opt.state[model.b.weight]["step"].item() == 2  # stepped only when b was used


def test_tied_parameters_step_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(torch.tanh(self.mid(self.emb(idx))))

    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    assert ref.out.weight is ref.emb.weight
    opt = InBackwardOptimizer(model, torch.optim.AdamW, fused=True, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, lr=1e-2)
    assert len(opt.param_groups[0]["params"]) == 3
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        idx = torch.randint(0, 10, (5,), generator=g)
        model(idx).logsumexp(-1).mean().backward()
        ref(idx).logsumexp(-1).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert opt.state[model.emb.weight]["step"].item() == 4


def test_a_failed_backward_leaves_the_next_one_correct():
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    data = batches(3)
    loss_of(model, data[0]).backward()
    train_standard(ref, ref_opt, data[:1])

    def boom(_grad):
        raise RuntimeError("boom")

    x, y = data[1]
    before = [p.detach().clone() for p in model.parameters()]
    h = torch.tanh(model.layers[0](x))
    h.register_hook(boom)  # fails midway: buckets near the head are stepped, the first layer's are not
    out = model.head(model.norm(torch.tanh(model.layers[2](torch.tanh(model.layers[1](h))))))
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.mse_loss(out, y).backward()
    stepped = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    assert any(stepped) and not all(stepped)
    model.zero_grad()  # as after any failed backward: drop the gradients it left behind
    # The reference steps exactly the parameters the failed backward stepped, on the same gradients.
    loss_of(ref, data[1]).backward()
    for p, was_stepped in zip(ref.parameters(), stepped):
        if not was_stepped:
            p.grad = None
    ref_opt.step()
    ref_opt.zero_grad()
    assert_same_params(model, ref)
    # and the next backward is a whole, correct step again
    loss_of(model, data[2]).backward()
    train_standard(ref, ref_opt, data[2:])
    assert_same_params(model, ref)
    assert all(p.grad is None for p in model.parameters()) and opt is not None


def test_reentrant_checkpointing_is_refused_loudly():
    """A reentrant checkpoint runs a backward inside the backward; exact in-backward steps are impossible there."""
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, per_parameter=True)
    x, y = batches(1)[0]
    h = torch.utils.checkpoint.checkpoint(model.layers[0], x.requires_grad_(), use_reentrant=True)
    loss = nn.functional.mse_loss(model.head(model.norm(torch.tanh(model.layers[1](h)))), y)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss.backward()
    # the non-reentrant checkpoint is exact
    model, ref = twins()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m in (model, ref):
        h = torch.utils.checkpoint.checkpoint(m.layers[0], x, use_reentrant=False)
        nn.functional.mse_loss(m.head(m.norm(torch.tanh(m.layers[1](h)))), y).backward()
    ref_opt.step()
    assert_same_params(model, ref)
    assert opt is not None


@pytest.mark.parametrize("setting", ["per_parameter", "head-over-the-cap"])
def test_reentrant_checkpointing_is_refused_before_a_bucket_outside_it_steps(setting):
    """The head's gradient arrives before the segment's inner backward starts; with a bucket of its own (one per
    tensor, or a head larger than the cap, as an LM head is) it used to be stepped before the refusal. The segment
    is found in the graph at the first hook instead: nothing stepped, no state, no half-applied step."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    head_bytes = model.head.weight.numel() * 4
    ib = {"per_parameter": True} if setting == "per_parameter" else {"bucket_cap_mb": (head_bytes - 1) / 2**20}
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ib, lr=0.1, fused=True)
    x, y = batches(1)[0]

    def forward(reentrant: bool) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(model.layers[0], x.clone().requires_grad_(), use_reentrant=reentrant)
        return nn.functional.mse_loss(model.head(model.norm(torch.tanh(model.layers[1](h)))), y)

    for _ in range(2):  # and again: the refusal does not depend on having seen one
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            forward(reentrant=True).backward()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert not opt.state and not opt.step_incomplete
    # the refused backward's gradient went with it: the non-reentrant checkpoint's next backward is exact at once
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward(reentrant=False).backward()
    h = torch.utils.checkpoint.checkpoint(ref.layers[0], x.clone().requires_grad_(), use_reentrant=False)
    nn.functional.mse_loss(ref.head(ref.norm(torch.tanh(ref.layers[1](h)))), y).backward()
    ref_opt.step()
    assert_same_params(model, ref)


def test_reentrant_checkpointing_first_used_in_a_later_backward_is_refused_with_the_step_incomplete():
    """The graph is read in the first stepping backward only: a segment that appears later is refused when its own
    backward begins, after the head's bucket (one per tensor here) was stepped, as documented."""
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, per_parameter=True, lr=0.1)
    x, y = batches(1)[0]

    def forward(reentrant: bool) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(model.layers[0], x.clone().requires_grad_(), use_reentrant=reentrant)
        return nn.functional.mse_loss(model.head(model.norm(torch.tanh(model.layers[1](h)))), y)

    forward(reentrant=False).backward()
    head, first = model.head.weight.detach().clone(), model.layers[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        forward(reentrant=True).backward()
    assert opt.step_incomplete
    assert not torch.equal(model.head.weight, head) and torch.equal(model.layers[0].weight, first)


@pytest.mark.parametrize("per_parameter", [False, True])
def test_reentrant_segments_holding_every_parameter_are_refused(per_parameter):
    """Every parameter inside reentrant segments: each segment's inner backward would look like a whole training
    step (steps, clipping and accumulation per segment). Refused before anything is stepped."""
    model = make_model()
    before = [p.clone() for p in model.parameters()]
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, per_parameter=per_parameter, max_grad_norm=1.0,
                              clip_mode="per_parameter")
    x, y = batches(1)[0]
    h = x.requires_grad_()
    for layer in model.layers:
        h = torch.utils.checkpoint.checkpoint(lambda t, m=layer: torch.tanh(m(t)), h, use_reentrant=True)
    out = torch.utils.checkpoint.checkpoint(lambda t: model.head(model.norm(t)), h, use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        nn.functional.mse_loss(out, y).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt is not None


def test_torch_private_function_leaks_where_we_do_not():
    """The reason this project exists: torch's version keeps every parameter alive forever."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = make_model()
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    ref = weakref.ref(model.head.weight)
    del model
    gc.collect()
    assert ref() is not None


def test_two_optimizers_cannot_consume_the_same_gradient():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\[0\] is already stepped in backward by "
                                         "InBackwardOptimizer"):
        InBackwardOptimizer(model.head.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="parameter head.bias is already stepped"):
        InBackwardOptimizer([("head.bias", model.head.bias)], torch.optim.AdamW)
    opt.remove()
    other = InBackwardOptimizer(model.head.parameters(), torch.optim.AdamW)  # fine once the first let go
    assert other.param_groups[0]["params"][0] is model.head.weight


def test_results_do_not_depend_on_bucket_size():
    data = batches(4)
    results = []
    for kwargs in ({"per_parameter": True}, {"bucket_cap_mb": 1e-4}, {}):
        model = make_model()
        opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **kwargs)
        for batch in data:
            loss_of(model, batch).backward()
        results.append((model, opt))
    ref = make_model()
    train_standard(ref, torch.optim.AdamW(ref.parameters(), fused=True), data)
    for model, _ in results:
        assert_same_params(model, ref)


@pytest.mark.parametrize("setting", ["per_parameter", "buckets"])
def test_a_hook_registered_after_the_optimizer_is_named_before_it_sees_none(setting):
    """A user's post-accumulate-grad hook registered after the optimizer's runs once the bucket its tensor completes
    is stepped and freed: it finds ``.grad`` ``None`` (from the first backward per parameter, from the second with
    learned buckets). That tensor is named once, with register_bucket_step_hook as the fix, before it can."""
    model = make_model()
    early: list[bool] = []  # a hook registered before the optimizer's sees every gradient, and is not named
    model.head.bias.register_post_accumulate_grad_hook(lambda p: early.append(p.grad is None))
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, per_parameter=setting == "per_parameter")
    seen: list[tuple[str, bool, int]] = []  # (parameter, .grad is None, warnings so far)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append((name, p.grad is None, len(caught))))
        for batch in batches(3):
            loss_of(model, batch).backward()
    named = [w for w in caught if "register_bucket_step_hook" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    blind = [(name, k) for name, none, k in seen if none]
    assert blind, "no hook saw None: the scenario tests nothing"
    assert all(k >= 1 for _, k in blind), f"a hook saw None before the warning: {blind}"
    assert str(named[0].message).startswith(blind[0][0] + " has a post-accumulate-grad hook registered after")
    assert early == [False] * 3 and opt.last_step.params_stepped == 10

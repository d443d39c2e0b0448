"""Gradient accumulation in backward against the standard loop that steps every k micro-batches."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    ADAMW,
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    twins,
)

from dist_optim import InBackwardOptimizer


def _standard_accumulating(model, data, k, weights, **opt_kwargs):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, **opt_kwargs)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for j, batch in enumerate(data):
        (loss_of(model, batch) * weights[j]).backward()
        if (j + 1) % k == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
    return opt


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_accumulation_steps_equals_stepping_every_k_micro_batches(k):
    model, ref = twins()
    data = batches(3 * k)
    weights = [1.0 / k] * len(data)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, accumulation_steps=k, **ADAMW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    steps = []
    opt.register_step_post_hook(lambda o, a, kw: steps.append(o.micro_batches))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for j, batch in enumerate(data):
            (loss_of(model, batch) * weights[j]).backward()
            stepped = (j + 1) % k == 0
            assert (model.head.weight.grad is None) == stepped  # held between steps, freed by the step
            assert opt.micro_batches == (0 if stepped else (j + 1) % k)
            if stepped:
                sched.step()
    ref_opt = _standard_accumulating(ref, data, k, weights)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert steps == [0, 0, 0]  # step hooks fire once per optimizer step, not per micro-batch


def test_unequal_micro_batches_keep_the_users_loss_scaling():
    model, ref = twins()
    g = torch.Generator().manual_seed(5)
    sizes = [2, 7, 3, 5, 1, 6]  # two steps of three micro-batches of unequal size
    data = [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in sizes]
    weights = []
    for s in range(2):
        chunk = sizes[3 * s : 3 * s + 3]
        weights += [n / sum(chunk) for n in chunk]  # token-weighted mean over the whole step
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, accumulation_steps=3, **ADAMW)
    for j, batch in enumerate(data):
        (loss_of(model, batch) * weights[j]).backward()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for j, batch in enumerate(data):
        (loss_of(ref, batch) * weights[j]).backward()
        if j % 3 == 2:
            ref_opt.step()
            ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert opt.state[model.head.weight]["step"].item() == 2


def test_no_step_context_accumulates_like_ddp_no_sync():
    model, ref = twins()
    data = batches(6)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for j, batch in enumerate(data):
        if j % 3 != 2:
            with opt.no_step():
                (loss_of(model, batch) / 3).backward()
            assert opt.micro_batches == 0  # no_step backwards do not count towards accumulation_steps
        else:
            (loss_of(model, batch) / 3).backward()
            sched.step()
    ref_opt = _standard_accumulating(ref, data, 3, [1 / 3] * 6)
    assert_same_params(model, ref)
    assert opt is not None and ref_opt is not None


def test_step_flushes_a_partial_window_at_the_end_of_an_epoch():
    model, ref = twins()
    data = batches(5)  # k=2: steps after micro-batches 2 and 4; the 5th is left over
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, accumulation_steps=2, **ADAMW)
    for batch in data:
        (loss_of(model, batch) / 2).backward()
    assert opt.micro_batches == 1 and model.head.weight.grad is not None
    opt.step()  # the standard "last step of the epoch"
    assert opt.micro_batches == 0
    opt.zero_grad()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for j, batch in enumerate(data):
        (loss_of(ref, batch) / 2).backward()
        if j % 2 == 1 or j == len(data) - 1:
            ref_opt.step()
            ref_opt.zero_grad()
    assert_same_params(model, ref)


def test_accumulation_with_exact_clipping_equals_clip_then_step():
    model, ref = twins()
    data = batches(6)
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, accumulation_steps=3, max_grad_norm=0.5, **ADAMW)
    norms = []
    for j, batch in enumerate(data):
        (loss_of(model, batch) / 3).backward()
        if j % 3 == 2:
            norms.append(opt.grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ref_norms = []
    for j, batch in enumerate(data):
        (loss_of(ref, batch) / 3).backward()
        if j % 3 == 2:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            ref_opt.step()
            ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms)) and ref_norms[0] > 0.5


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2"])
def test_accumulation_steps_must_be_a_positive_int(bad):
    model, _ = twins()
    with pytest.raises(ValueError, match=f"accumulation_steps must be an int >= 1, got {bad!r}"):
        InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, accumulation_steps=bad)

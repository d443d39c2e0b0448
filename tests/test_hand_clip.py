"""A hand-written loop that clips with torch after an in-backward step (``loss.backward(); clip_grad_norm_(...);
opt.step()``) clips nothing, since backward freed the gradients: ``step()`` says so once, naming the fix; the loops
where torch's clipping does act, or the optimizer clips itself, stay silent."""

from __future__ import annotations

import warnings

import pytest
import torch

import dist_optim


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def loop_clipping_by_norm(opt, m, steps: int = 3) -> list[float]:
    norms = []
    for k in range(steps):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(k))).square().mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3).item())
        opt.step()
        opt.zero_grad()
    return norms


def test_clip_grad_norm_after_a_stepping_backward_is_said_once():
    m = model()
    opt = dist_optim.InBackwardOptimizer(m, torch.optim.SGD, lr=0.1)
    with pytest.warns(UserWarning, match=r"from loop_clipping_by_norm\(\), which calls torch.nn.utils.clip_grad_norm_: "
                      r"it found no gradients, returned 0 and clipped nothing.*max_grad_norm=1.0, "
                      r"clip_mode='two_pass'") as record:
        norms = loop_clipping_by_norm(opt, m)
    assert norms == [0.0, 0.0, 0.0]  # what the user saw: the reason for the warning
    assert len([w for w in record if "clipped nothing" in str(w.message)]) == 1


def standard_step_then_clip(opt, m) -> None:
    with opt.no_step():  # a standard step: the gradients are there, torch's clipping acts
        m(torch.ones(2, 8)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3) > 0
    opt.step()


def no_clipping(opt, m) -> None:
    m(torch.ones(2, 8)).sum().backward()
    opt.step()


@pytest.mark.parametrize("loop", [loop_clipping_by_norm, standard_step_then_clip, no_clipping])
def test_loops_where_the_clipping_acts_or_is_not_asked_for_are_silent(loop):
    m = model()
    options = dict(max_grad_norm=1e-3, clip_mode="per_parameter") if loop is loop_clipping_by_norm else {}
    opt = dist_optim.InBackwardOptimizer(m, torch.optim.SGD, lr=0.1, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop(opt, m)

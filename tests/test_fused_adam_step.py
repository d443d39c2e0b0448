"""The fused Adam/AdamW step the engine runs on a bucket (``_direct_steps.FusedAdamStep``): torch's own kernel called
on the bucket's tensors without ``torch.optim``'s per-tensor bookkeeping. Bitwise the standard loop with the same
fused optimizer, for every option it takes, and torch's own step wherever it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dist_optim
from dist_optim.engine._direct_steps import FusedAdamStep

OPTIONS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam-coupled-decay": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    "AdamW-amsgrad-maximize": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    "Adam-tensor-lr": (torch.optim.Adam, {"lr": torch.tensor(1e-2)}),  # torch's own step: the kernel takes a float
}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3)])
        self.unused = nn.Linear(8, 8)  # never gets a gradient: its bucket steps the others alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _steppers(opt) -> list[FusedAdamStep]:
    return [i.step for b in opt._engine.buckets for i in b.inners]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_bucket_step_equals_the_standard_fused_loop(name):
    cls, kw = OPTIONS[name]
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                  fused=True)  # a tensor lr is changed in place by its scheduler: one each
    ref_lr = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    opt = dist_optim.InBackwardOptimizer(model, cls, **kw, fused=True, bucket_cap_mb=1e-3)  # several buckets
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # lr changes between steps
    for step in range(4):
        x = torch.randn(4, 8)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_lr.step()
        model(x).square().mean().backward()
        lr.step()
    steppers = _steppers(opt)
    assert len(steppers) > 1 and all(isinstance(s, FusedAdamStep) for s in steppers)
    # torch's own step creates the state in the first; the kernel is called directly after (not with a tensor lr)
    assert [s.direct for s in steppers] == [0 if isinstance(kw["lr"], torch.Tensor) else 3] * len(steppers)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
        assert opt.state[p].keys() == ref_opt.state[q].keys(), n
        assert all(torch.equal(v, ref_opt.state[q][k]) for k, v in opt.state[p].items()), n
    assert model.unused.weight not in opt.state or not opt.state[model.unused.weight]


def test_a_subclass_takes_its_own_step():
    class Halved(torch.optim.AdamW):  # a subclass may change the step: never replaced
        pass

    model = Model()
    opt = dist_optim.InBackwardOptimizer(model, Halved, lr=1e-2, fused=True)
    model(torch.randn(2, 8)).sum().backward()
    assert _steppers(opt) and not any(isinstance(s, FusedAdamStep) for s in _steppers(opt))


def test_an_option_this_step_does_not_know_takes_torchs_step(monkeypatch):
    # a torch with an Adam option FusedAdamStep was not written for: torch's own step, never a silent difference
    monkeypatch.setattr(FusedAdamStep, "KNOWN", FusedAdamStep.KNOWN - {"maximize"})
    model = Model()
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
    assert _steppers(opt) and all(s.direct == 0 for s in _steppers(opt))
    assert all(int(opt.state[p]["step"]) == 3 for p in model.layers.parameters())  # stepped, by torch's step

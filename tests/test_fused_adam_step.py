"""The fused Adam/AdamW step the engine runs on a bucket (``_stepper.FusedAdamStep``): torch's own kernel called
on the bucket's tensors without ``torch.optim``'s per-tensor bookkeeping. Bitwise the standard loop with the same
fused optimizer, for every option it takes, and torch's own step wherever it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dist_optim
from dist_optim._stepper import FusedAdamStep

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


def _counting_init_group(monkeypatch) -> list[int]:
    calls = [0]
    original = torch.optim.Adam._init_group

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "_init_group", counted)
    return calls


@pytest.mark.parametrize("name", list(OPTIONS))
def test_bucket_step_equals_the_standard_fused_loop(name, monkeypatch):
    cls, kw = OPTIONS[name]
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                  fused=True)  # a tensor lr is changed in place by its scheduler: one each
    ref_lr = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    opt = dist_optim.InBackwardOptimizer(model, cls, **kw, fused=True, bucket_cap_mb=1e-3)  # several buckets
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # lr changes between steps
    calls = _counting_init_group(monkeypatch)
    for step in range(4):
        x = torch.randn(4, 8)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_lr.step()
        before = calls[0]
        model(x).square().mean().backward()
        lr.step()
        inner_calls = calls[0] - before
        if step > 0 and not isinstance(kw["lr"], torch.Tensor):
            assert inner_calls == 0, "torch's per-tensor bookkeeping ran on a bucket after the first step"
    assert all(isinstance(i.step, FusedAdamStep) for b in opt._engine.buckets for i in b.inners)
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
    assert opt.buckets and not any(isinstance(i.step, FusedAdamStep) for b in opt._engine.buckets for i in b.inners)


def test_an_option_this_step_does_not_know_takes_torchs_step(monkeypatch):
    # a torch with an Adam option FusedAdamStep was not written for: torch's own step, never a silent difference
    monkeypatch.setattr(FusedAdamStep, "KNOWN", FusedAdamStep.KNOWN - {"maximize"})
    calls = _counting_init_group(monkeypatch)
    model = Model()
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    assert opt.buckets and calls[0] >= 2

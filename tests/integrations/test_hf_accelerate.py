"""InBackwardAccelerator against accelerate's standard loop with fused AdamW: accumulation (with a short last
window), clipping by norm and by value, the returned norms, save_state/load_state; the naive swap's clipping,
which cannot be seen (its accumulation: test_naive_swap.py)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("accelerate", reason="the accelerate adapter is tested with accelerate installed")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from helpers import assert_same_params, assert_same_state, make_model  # noqa: E402

from dist_optim import InBackwardOptimizer  # noqa: E402
from dist_optim.integrations.hf_accelerate import InBackwardAccelerator  # noqa: E402

ADAMW = dict(lr=1e-2, weight_decay=0.1, fused=True)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # Accelerator's state is a process-wide singleton: each run starts from a clean one, as a new process would.
    yield
    reset_accelerate()


def loader(n: int = 7) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n * 6, 8, generator=g), torch.randn(n * 6, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=6, shuffle=False)


def run(accelerator_cls, in_backward: bool, accum: int = 1, clip: str | None = None, epochs: int = 1, model=None,
        **engine):
    """One accelerate loop as its docs write it; returns the model, the optimizer and the norms it got.
    ``engine``: further engine options of the in-backward optimizer."""
    accelerator = accelerator_cls(cpu=True, gradient_accumulation_steps=accum)
    model = make_model() if model is None else model
    if in_backward:
        options = {"norm": dict(max_grad_norm=1.0), "value": dict(max_grad_value=0.05), None: {}}[clip]
        opt = InBackwardOptimizer(model, torch.optim.AdamW, **options, **engine, **ADAMW)
    else:
        opt = torch.optim.AdamW(model.named_parameters(), **ADAMW)
    model, opt, dl = accelerator.prepare(model, opt, loader())
    norms = []
    for _ in range(epochs):
        for x, y in dl:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients and clip is not None:
                    clip_after_backward(accelerator, model, clip, norms)
                opt.step()
                opt.zero_grad()
    return accelerator.unwrap_model(model), opt, norms


def clip_after_backward(accelerator, model, clip: str, norms: list) -> None:
    """The loop's clipping call, kept out of ``run``'s own code: the optimizer alone in a plain ``Accelerator``
    reads the loop's code and refuses a loop that names a clipping call (tests/integrations/test_naive_swap.py)."""
    if clip == "norm":
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
    else:
        accelerator.clip_grad_value_(model.parameters(), 0.05)


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize("accum", [1, 4])
def test_adapter_equals_the_standard_loop(accum, clip):
    # 7 micro-batches: with accum=4 the last window has 3, stepped at the end of the data loader
    ref, ref_opt, ref_norms = run(Accelerator, False, accum, clip)
    reset_accelerate()
    model, opt, norms = run(InBackwardAccelerator, True, accum, clip)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert ref_opt.state_dict()["state"][0]["step"].item() == math.ceil(7 / accum)
    assert len(norms) == len(ref_norms) and all(torch.equal(a, b) for a, b in zip(norms, ref_norms))


@pytest.mark.parametrize("accum", [1, 4])
def test_two_pass_clipping_equals_the_standard_loop(accum):
    ref, ref_opt, ref_norms = run(Accelerator, False, accum, "norm")
    reset_accelerate()
    model, opt, norms = run(InBackwardAccelerator, True, accum, "norm", clip_mode="two_pass")
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert max(n.item() for n in ref_norms) > 1.0  # the clipping fired
    assert len(norms) == len(ref_norms) and all(torch.equal(a, b) for a, b in zip(norms, ref_norms))


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_epoch(accelerator, model, opt, dl) -> None:
    for x, y in dl:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()


def test_save_state_and_load_state_resume_exactly(tmp_path):
    ref, ref_opt, _ = run(Accelerator, False, accum=2, epochs=2)
    reset_accelerate()
    saver = InBackwardAccelerator(cpu=True, gradient_accumulation_steps=2)
    first = make_model()
    parts = saver.prepare(first, InBackwardOptimizer(first, torch.optim.AdamW, **ADAMW), loader())
    train_epoch(saver, *parts)
    saver.save_state(str(tmp_path / "ckpt"))
    reset_accelerate()
    accelerator = InBackwardAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model(seed=5)  # other weights: load_state must bring the saved ones
    model, opt, dl = accelerator.prepare(model, InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW), loader())
    accelerator.load_state(str(tmp_path / "ckpt"))
    train_epoch(accelerator, model, opt, dl)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_clipping_not_set_on_the_optimizer_is_refused():
    accelerator = InBackwardAccelerator(cpu=True)
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(torch.randn(2, 8)).sum())
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(max_norm=1.0\) runs after backward.*max_grad_norm=1.0"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"clip_grad_value_\(clip_value=0.5\).*max_grad_value=0.5"):
        accelerator.clip_grad_value_(model.parameters(), 0.5)
    with pytest.raises(ValueError, match="does not measure; build it with track_grad_norm=True"):
        accelerator.clip_grad_norm_(model.parameters(), math.inf)
    with pytest.raises(ValueError, match="exactly the optimizer's parameters"):
        accelerator.clip_grad_norm_(list(model.parameters())[:2], 1.0)


def test_accumulation_is_said_in_accelerate_s_terms():
    with pytest.warns(UserWarning, match=r"(?s)InBackwardAccelerator holds every gradient.*"
                      r"Accelerator\(gradient_accumulation_steps=2\).*gradient_accumulation_steps=1 and a DataLoader "
                      r"batch 2x larger") as record:
        run(InBackwardAccelerator, True, accum=2)
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1


def test_no_accumulation_keeps_the_saving_silently():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saves no gradient memory")
        _, opt, _ = run(InBackwardAccelerator, True, bucket_cap_mb=0.0001)
    assert 0 < opt.optimizer.last_step.grad_bytes_saved < opt.optimizer.grad_bytes

"""dist_optim.in_backward: the optimizer class that config systems build as cls(params, **kwargs); and the
runnable examples of the factory and of the adapters' docstrings."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys

import pytest
import torch
from helpers import (
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    train_in_backward,
    twins,
)

import dist_optim


def test_class_equals_the_standard_loop_and_fixes_engine_options():
    model, ref = twins()
    cls = dist_optim.in_backward(torch.optim.AdamW, max_grad_norm=0.5, bucket_cap_mb=1e-4)
    opt = cls(model.named_parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.named_parameters(), lr=1e-2, fused=True)
    data = batches(3)
    train_in_backward(model, data)
    for batch in data:
        loss_of(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert cls.__name__ == "InBackwardAdamW" and issubclass(cls, torch.optim.Optimizer)
    assert opt.max_grad_norm == 0.5 and len(opt.buckets) > 1


def test_an_instance_may_override_a_fixed_engine_option():
    opt = dist_optim.in_backward(torch.optim.SGD, max_grad_norm=0.5)(make_model().parameters(), lr=0.1,
                                                                    max_grad_norm=2.0)
    assert opt.max_grad_norm == 2.0


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match=r"option\(s\) lr that are not engine options.*cls\(params, lr=...\)"):
        dist_optim.in_backward(torch.optim.AdamW, lr=1e-3)
    with pytest.raises(TypeError, match="optimizer_class must be an optimizer class"):
        dist_optim.in_backward(torch.optim.AdamW(make_model().parameters()))
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        dist_optim.in_backward(torch.optim.AdamW, bucket_cap_mb=0)(make_model().parameters())


@pytest.mark.parametrize(("module", "framework"), [("dist_optim._factory", "torch"),
                                                   ("dist_optim.integrations.hf_accelerate", "accelerate")])
def test_docstring_examples_run(module, framework):
    pytest.importorskip(framework, reason=f"{module}'s example needs {framework}")
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_import_dist_optim_imports_no_framework():
    code = ("import sys, dist_optim, dist_optim.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'torchtune') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"

"""torch.compile: a model compiled whole hands every gradient over at once (said once, measured), per block keeps
the saving; both equal the standard loop under the same compile.

``backend="aot_eager"``: AOTAutograd splits forward and backward as inductor does, so gradients arrive in the same
pattern (one compiled backward node per compiled region), while the kernels stay eager ones: results are compared
bitwise, and the test needs no C++ compiler and a few seconds instead of inductor's minutes on CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_same_params, batches, loss_of, make_model, train_standard

from dist_optim import InBackwardOptimizer

pytest.importorskip("torch._dynamo")

LAYER_BYTES = (8 * 8 + 8) * 4  # one hidden Linear's gradients, float32


def _compile(model, whole: bool):
    if whole:
        model.compile(backend="aot_eager")
    else:
        for block in model.layers:
            block.compile(backend="aot_eager")
    return model


@pytest.mark.parametrize("whole", [True, False], ids=["whole_model", "per_block"])
def test_compiled_model_equals_the_standard_loop_and_only_whole_model_warns(whole):
    torch._dynamo.reset()
    model, ref = _compile(make_model(), whole), _compile(make_model(), whole)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, bucket_cap_mb=LAYER_BYTES / 2**20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    data = batches(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in data:
            loss_of(model, batch).backward()
    ours = [w for w in caught if "arrive at once" in str(w.message)]
    train_standard(ref, ref_opt, data)
    assert_same_params(model, ref)
    if whole:
        assert len(ours) == 1  # once per optimizer
        assert "block.compile()" in str(ours[0].message) and "10 gradients" in str(ours[0].message)
        assert opt.last_step.grad_bytes_peak == total and opt.last_step.grad_bytes_saved == 0
        assert "saves no gradient memory" in str(ours[0].message)  # the words of every lost-saving warning
    else:
        assert not [w for w in caught if "saves no gradient memory" in str(w.message)]
        assert 0 < opt.last_step.grad_bytes_peak <= 2 * LAYER_BYTES < total
        assert opt.last_step.grad_bytes_saved == total - opt.last_step.grad_bytes_peak

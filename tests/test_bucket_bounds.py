"""Where buckets end, one process: the in-backward peak stays within the activations alive when backward starts
plus one bucket (issue 15), because a bucket never ends between the tensors one autograd node computes together
(a Linear's bias and weight); and results stay those of the standard loop. The peak is the allocator's
(torch.profiler's memory events, ``benchmarks.bench_core.peak_vs_bound``); the FSDP2 rule (no bucket spans two
``fully_shard`` units) is tested on 2 gloo ranks in test_fsdp2.py's ``buckets/`` scenarios."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ADAMW, assert_same_params, assert_same_state
from torch import nn

from benchmarks.bench_core import peak_vs_bound
from benchmarks.harness import few_large, many_small
from dist_optim import InBackwardOptimizer

BOUND_SLACK = 1.05  # backward's own temporaries (the gradients of activations) on top of the bound


@pytest.mark.parametrize(
    "build, width, cap",
    [
        # 1.56 MiB weights, 4 MiB buckets: two blocks a bucket, the third's weight does not fit; the bucket used to
        # end between that Linear's bias and weight and be stepped with the weight's gradient already alive
        (lambda: many_small(640, 6), 640, 4.0),
        (lambda: many_small(640, 6), 640, 1.0),  # every Linear a bucket: its bias is not left behind on its own
        (lambda: few_large(1024, 3), 1024, 2.0),  # 4 MiB weights over a 2 MiB cap: each a bucket with its bias
    ],
    ids=["many_small-4MiB", "many_small-1MiB", "few_large-2MiB"],
)
def test_in_backward_peak_is_within_activations_plus_one_bucket(build, width, cap):
    r = peak_vs_bound(build, width, 8, cap, torch.device("cpu"))
    assert r["buckets"] > 1, r
    assert r["ratio"] <= BOUND_SLACK, (
        f"peak {r['peak_bytes']} B > {BOUND_SLACK} x (activations at backward start "
        f"{r['activations_at_backward_bytes']} B + largest bucket {r['largest_bucket_bytes']} B)")


def test_a_linear_s_bias_and_weight_share_a_bucket_whenever_they_fit():
    model = many_small(64, 6)
    linear_bytes = (64 * 64 + 64) * 4
    # a cap that fits a bit more than one Linear: a bucket fills with (Linear, LayerNorm) blocks and the next
    # Linear never fits whole, so every boundary falls at a Linear
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, bucket_cap_mb=1.5 * linear_bytes / 2**20)
    model(torch.randn(4, 64)).square().mean().backward()
    bucket_of = {id(p): k for k, b in enumerate(opt.buckets) for p in b}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    split = [k for k, m in enumerate(linears) if bucket_of[id(m.weight)] != bucket_of[id(m.bias)]]
    assert not split, f"Linear layers {split} have their bias and weight in different buckets"
    assert len(opt.buckets) >= len(linears) - 1  # the cap did close buckets at Linear layers


@pytest.mark.parametrize("cap", [4 * 64 * 65 / 2**20, 1.5 * 4 * 64 * 65 / 2**20, 1e-4],
                         ids=["one-Linear", "Linear-and-a-half", "tiny"])
def test_results_equal_the_standard_loop_bitwise(cap):
    torch.manual_seed(0)
    model = many_small(64, 6)
    ref_model = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    opt = InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=cap, **ADAMW)
    ref = torch.optim.AdamW(ref_model.named_parameters(), **ADAMW)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(4, 64, generator=g)
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        ref_model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    assert any(not torch.equal(p, q) for p, q in zip(ref_model.parameters(), initial))
    assert_same_params(model, ref_model)
    assert_same_state(opt.state_dict(), ref.state_dict())


def test_cap_sweep_reports_every_cap_within_the_bound():
    """``python -m benchmarks.bench_core --cap-sweep``, on a tiny model: a cap of 1/16 of the gradient bytes makes
    buckets where 1 MiB holds the whole model in one, and saves what the bound says it may."""
    from types import SimpleNamespace

    from benchmarks.bench_core import cap_sweep

    args = SimpleNamespace(batch=8, warmup=2, repeats=2, iters=1)
    (result,) = cap_sweep({"tiny": (64, 4)}, args, torch.device("cpu")).values()
    rows = result["caps"]
    assert set(rows) == {"1 MiB", "4 MiB", "16 MiB", "1/16 of gradients"}
    assert rows["1 MiB"]["buckets"] == 1 and rows["1 MiB"]["saving_of_grad_bytes"] < 0.05
    small = rows["1/16 of gradients"]
    assert small["buckets"] > 4 and small["peak_bytes"] < rows["1 MiB"]["peak_bytes"]
    assert small["saving_of_grad_bytes"] > 0.3
    assert all(r["ratio"] <= BOUND_SLACK and r["time_ratio"]["paired_median"] > 0 for r in rows.values()), rows

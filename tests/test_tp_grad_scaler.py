"""A ``GradScaler`` under tensor parallel alone (``parallelize_module`` with SequenceParallel norms, 2 gloo ranks):
``InBackwardOptimizer(..., grad_scaler=scaler)`` ends bitwise where the same TP model ends with the standard loop
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()``), through steps that overflow.

``torch.amp.GradScaler("cpu")`` runs on CPU: the scale, the unscale kernel
(``_amp_foreach_non_finite_check_and_unscale_``) and the skip are those of CUDA; only the loss is fp32 here, so
overflows are injected: an infinite loss (every gradient, every rank), or one element of rank 0's shard of one
gradient. On DTensor gradients torch reduces ``found_inf`` inside that kernel (DTensor's ``found_inf_reduce_handler``:
a max over the mesh dimensions on which the list's *first* gradient is not ``Replicate``), so in the standard loop an
overflow in one rank's shard skips the step on every rank when the first gradient of the list is sharded or partial
(here a SequenceParallel norm's).

The engine unscales bucket by bucket, so the reduction would follow each bucket's first gradient. A bucket whose
first gradient is ``Replicate`` (a RowwiseParallel bias, which shares its addmm node, and so its bucket, with the
Shard(1) weight) would not reduce: an overflow in rank 0's shard of that weight skipped the step on rank 0 alone, and
rank 1, stepping, waited in the collective of the norms' ``Partial`` gradients (a hang). The engine now puts the
gradient that is not ``Replicate`` on the most mesh dimensions first in each unscale call (``"down.weight"``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ADAMW

import dist_optim

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

if dist.is_available():
    from test_fsdp2 import _assert_same
    from test_tp import TINY_BUCKETS, _data, _twins
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

INIT_SCALE = 2.0**10  # a power of two: fused AdamW's unscale inside scaler.step rounds as the engine's unscale does
STEPS = 5
OVERFLOW_STEPS = {1, 3}


def _poison_shard(p: torch.Tensor, step: list[int]) -> None:
    """At the steps in OVERFLOW_STEPS, one element of rank 0's shard of ``p``'s gradient becomes infinite."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        if step[0] not in OVERFLOW_STEPS or dist.get_rank() != 0:
            return g
        local = g.to_local().clone()
        local.view(-1)[0] = float("inf")
        return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape,
                                  stride=g.stride())

    p.register_hook(hook)


def _scaled_parity(ctx, poison: str) -> None:
    """``poison``: "loss" (an infinite loss) or the name of a sharded parameter of the first block, made infinite in
    rank 0's shard alone. Buckets of a few tensors, so that they complete, and are unscaled, one by one."""
    mesh = ctx["tp"]
    a, b, initial = _twins(mesh, sequence_parallel=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, grad_scaler=scaler,
                                         **ADAMW)
    ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
    # the standard loop's list starts with a Partial gradient (blocks.0.norm.weight): its found_inf is reduced
    assert next(iter(b.parameters())).placements == (Replicate(),)
    step = [0]
    if poison != "loss":
        for m in (a, b):
            _poison_shard(m.blocks[0].get_parameter(poison), step)
    scales, ref_scales = [], []
    for k, x in enumerate(_data(mesh, 0, True, steps=STEPS)):
        step[0] = k
        factor = float("inf") if poison == "loss" and k in OVERFLOW_STEPS else 1.0
        scaler.scale(a(x).square().mean() * factor).backward()  # unscaled, checked and stepped inside
        assert all(p.grad is None for p in a.parameters())
        scaler.update()
        scales.append(scaler.get_scale())
        ref_scaler.scale(b(x).square().mean() * factor).backward()
        ref_scaler.step(ref)
        ref_scaler.update()
        ref.zero_grad()
        ref_scales.append(ref_scaler.get_scale())
    assert scales == ref_scales, (scales, ref_scales)
    want = INIT_SCALE / 2  # backed off at step 1, grew after 2 clean steps, backed off at step 3
    assert scales == [INIT_SCALE, want, want, want / 2, want / 2], scales
    _assert_same(a, [opt.state_dict()], b, [ref.state_dict()], initial)


def _on_tp_mesh(ctx, **kwargs) -> None:
    mesh = ctx.cached("tp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))
    _scaled_parity({"rank": ctx.rank, "world": ctx.world, "tp": mesh}, **kwargs)


@pytest.mark.parametrize("poison", [
    "loss",
    "up.weight",  # ColwiseParallel: its bucket (weight and bias, Shard(0)) reduces found_inf over the TP ranks
    "down.weight",  # RowwiseParallel: its bucket starts with the Replicate bias; the engine puts the Shard(1) weight
    # first in the unscale call, so that found_inf is reduced over the TP ranks as in the standard loop
])
def test_grad_scaler_under_tp_equals_scaler_step(ranks, poison):
    ranks.run(2, _on_tp_mesh, poison=poison)

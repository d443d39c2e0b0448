"""clip_mode="two_pass": a measuring backward, then a stepping one, against ``clip_grad_norm_(c); opt.step()``.

Bitwise with the same optimizer and kernel (both passes compute the same gradients here: CPU kernels are
deterministic), the memory saving kept (``grad_bytes_peak``), GradScaler and non-finite skips decided by the first
pass, accumulation, and the refusals: a plain ``loss.backward()`` in this mode, a second backward over a retained
graph after a stepping one, FSDP2's DTensor parameters given as tensors (2 gloo ranks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    ADAMW,
    SGD_MOMENTUM,
    WIDTH,
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    twins,
)
from torch import nn

from dist_optim import InBackwardOptimizer

OPTIMIZERS = {"AdamW-fused": (torch.optim.AdamW, ADAMW), "SGD-momentum": (torch.optim.SGD, SGD_MOMENTUM)}
BUCKETS = {"buckets": dict(bucket_cap_mb=1e-4), "per_parameter": dict(per_parameter=True)}


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("buckets", BUCKETS)
@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_pass_equals_clip_grad_norm_then_step(optimizer, max_norm, buckets):
    cls, kwargs = OPTIMIZERS[optimizer]
    model, ref = twins()
    opt = InBackwardOptimizer(model, cls, max_grad_norm=max_norm, clip_mode="two_pass", **BUCKETS[buckets], **kwargs)
    ref_opt = cls(ref.named_parameters(), **kwargs)
    coefs = []
    for batch in batches(4):
        opt.backward(loss_of(model, batch))
        loss_of(ref, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(opt.grad_norm, norm)
        assert torch.equal(opt.last_step.clip_coef, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        coefs.append(opt.last_step.clip_coef.item())
        assert all(p.grad is None for p in model.parameters())
        # the saving kept: never all the gradients alive at once (exact mode holds them all)
        assert 0 < opt.last_step.grad_bytes_peak < _grad_bytes(model)
    assert (min(coefs) < 1.0) == (max_norm < 1)  # the clipping fired where it should, and only there
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_step_hooks_and_schedulers_see_one_step_per_two_pass_step():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=0.1, clip_mode="two_pass")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    posts, buckets = [], []
    opt.register_step_post_hook(lambda o, a, k: posts.append(1))
    opt.register_bucket_step_hook(lambda o, params: buckets.append(len(params)))
    for batch in batches(3):
        opt.backward(loss_of(model, batch))
        opt.step()
        sched.step()
    assert len(posts) == 3 and sum(buckets) == 3 * 10  # once per step, each tensor once
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**3


def _poisoned_loss(model, batch, poison: bool) -> torch.Tensor:
    return loss_of(model, batch) * (float("inf") if poison else 1.0)


def test_grad_scaler_overflow_skips_the_step_without_a_stepping_pass():
    model, ref = twins()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    opt = InBackwardOptimizer(model, torch.optim.AdamW, grad_scaler=scaler, max_grad_norm=0.5, clip_mode="two_pass",
                              bucket_cap_mb=1e-4, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.named_parameters(), **ADAMW)
    stepped = []
    opt.register_bucket_step_hook(lambda o, params: stepped.append(len(params)))
    scales, ref_scales = [], []
    for j, batch in enumerate(batches(4)):
        passes = []
        loss = scaler.scale(_poisoned_loss(model, batch, j == 1))
        loss.grad_fn.register_prehook(lambda g: passes.append(1))  # counts the backwards through this graph
        stepped.clear()
        opt.backward(loss)
        assert len(passes) == (1 if j == 1 else 2) and (sum(stepped) == 0) == (j == 1)
        assert opt.last_step.overflow == (j == 1)
        scaler.update()
        scales.append(scaler.get_scale())
        ref_scaler.scale(_poisoned_loss(ref, batch, j == 1)).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        ref_scales.append(ref_scaler.get_scale())
    assert scales == ref_scales and scales[1] == 2.0**9
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_nonfinite_skip_is_decided_by_the_measuring_pass():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, nonfinite="skip", max_grad_norm=1.0, clip_mode="two_pass")
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(_poisoned_loss(model, batches(1)[0], True))
    assert opt.last_step.overflow and opt.last_step.params_stepped == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["accumulation_steps", "no_step"])
def test_accumulation_holds_the_last_micro_batch_as_exact_clipping_does(how):
    model, ref = twins()
    extra = dict(accumulation_steps=2) if how == "accumulation_steps" else {}
    opt = InBackwardOptimizer(model, torch.optim.AdamW, max_grad_norm=0.05, clip_mode="two_pass", bucket_cap_mb=1e-4,
                              **extra, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.named_parameters(), **ADAMW)
    data = batches(6)
    for k in range(0, 6, 2):
        for j in (k, k + 1):
            loss = loss_of(model, data[j]) / 2
            if how == "no_step" and j == k:
                with opt.no_step():
                    opt.backward(loss)
            else:
                opt.backward(loss)
            (loss_of(ref, data[j]) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(opt.grad_norm, norm) and opt.last_step.clip_coef < 1
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_a_plain_backward_is_refused_before_anything_steps():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=1.0, clip_mode="two_pass")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"clip_mode='two_pass' steps through opt.backward\(loss\).*refused before"):
        loss_of(model, batches(1)[0]).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not opt.step_incomplete
    # the gradient it left (its first tensor's) went with it: the next backward steps every tensor, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.backward(loss_of(model, batches(1)[0]))
    assert opt.last_step.params_stepped == 10
    with opt.no_step():  # a backward that only accumulates needs no measuring pass: a plain one is fine
        loss_of(model, batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_second_backward_over_a_graph_that_stepped_is_refused():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)
    loss = loss_of(model, batches(1)[0])
    loss.backward(retain_graph=True)
    after = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="ran again over a graph kept with retain_graph=True.*already stepped"):
        loss.backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after))
    assert opt.last_step.params_stepped == 10
    loss_of(model, batches(1)[0]).backward()  # a new forward steps as usual


def test_passes_that_compute_different_gradients_warn():
    model = make_model()
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=1.0, clip_mode="two_pass")
    x, y = batches(1)[0]
    factors = iter([1.0, 1.5])
    h = model.layers[0](x)
    h.register_hook(lambda g: g * next(factors))  # as a non-deterministic kernel would
    for layer in model.layers[1:]:
        h = layer(torch.tanh(h))
    loss = nn.functional.mse_loss(model.head(model.norm(torch.tanh(h))), y)
    with pytest.warns(UserWarning, match="two backwards of clip_mode='two_pass' computed different gradients"):
        opt.backward(loss)


def test_plain_backward_without_two_pass_is_loss_backward():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, max_grad_norm=0.05, **ADAMW)  # exact
    ref_opt = torch.optim.AdamW(ref.named_parameters(), **ADAMW)
    for batch in batches(2):
        opt.backward(loss_of(model, batch))
        loss_of(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref)


def test_a_standard_step_on_gradients_set_by_hand_clips_exactly():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.SGD, max_grad_norm=0.05, clip_mode="two_pass", **SGD_MOMENTUM)
    ref_opt = torch.optim.SGD(ref.named_parameters(), **SGD_MOMENTUM)
    opt.remove()  # gradients now stay in .grad; step() steps them
    for batch in batches(2):
        loss_of(model, batch).backward()
        loss_of(ref, batch).backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_params(model, ref)


def test_configure_clipping_switches_to_two_pass_between_steps():
    model, ref = twins()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.named_parameters(), **ADAMW)
    for k, batch in enumerate(batches(4)):
        if k == 2:
            opt.configure_clipping(max_grad_norm=0.05, clip_mode="two_pass")
        opt.backward(loss_of(model, batch))
        loss_of(ref, batch).backward()
        if k >= 2:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt.clip_mode == "two_pass" and opt.last_step.clip_coef < 1
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def _dtensors_given_as_tensors(ctx):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.cached("fsdp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))
    model = make_model(width=WIDTH)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = list(model.parameters())  # the optimizer's: the module registers unsharded ones after a forward
    opt = InBackwardOptimizer(sharded, torch.optim.SGD, lr=0.1, clip_mode="two_pass", max_grad_norm=1)
    before = [p.detach().to_local().clone() for p in sharded]
    loss = loss_of(model, batches(1, width=WIDTH, seed=10 + ctx.rank)[0])
    with pytest.raises(NotImplementedError, match=r"clip_mode='two_pass' over DTensor parameters given as tensors: "
                                                  r"build the optimizer from the model \(InBackwardOptimizer\(model"):
        opt.backward(loss)
    assert all(p.grad is None for p in sharded)  # refused before the backward ran
    assert all(torch.equal(p.detach().to_local(), q) for p, q in zip(sharded, before))
    assert not opt.state and not opt.step_incomplete
    dist.barrier()


def test_two_pass_over_dtensors_given_as_tensors_is_refused_before_anything_runs(ranks):
    # without the model the optimizer cannot see the gradients FSDP2 accumulates without sync, which the
    # measuring pass would have to keep out of its norm
    ranks.run(2, _dtensors_given_as_tensors)


class _NormBlocks(nn.Module):
    """Blocks of Linear + BatchNorm1d (running statistics in train mode), each under non-reentrant checkpointing;
    ``counter`` a buffer of another kind that each block's forward bumps."""

    def __init__(self, counter: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 1)
        self.counter = counter
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def _block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.counter:
            self.calls.add_(1)
        return block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(self._block, block, x, use_reentrant=False)
        return self.head(x).square().mean()


def test_two_pass_under_checkpointing_leaves_the_running_statistics_as_the_standard_loop():
    torch.manual_seed(0)
    model = _NormBlocks()
    ref = _NormBlocks()
    ref.load_state_dict(model.state_dict())
    opt = InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=0.1, clip_mode="two_pass",
                              bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # running statistics are restored: nothing to say
            opt.backward(model(x))
    assert_same_params(model, ref)
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), name  # num_batches_tracked 8, not 12; running_mean and running_var the same
    assert int(model.blocks[0][1].num_batches_tracked) == 8  # a forward and a recompute per step
    model.eval(), ref.eval()
    x = torch.randn(5, 6)
    assert torch.equal(model(x), ref(x))  # evaluation with the trained model is the standard loop's


def test_two_pass_names_a_buffer_its_measuring_pass_changed_and_cannot_restore():
    torch.manual_seed(0)
    model = _NormBlocks(counter=True)
    opt = InBackwardOptimizer(model, torch.optim.SGD, lr=1e-2, max_grad_norm=0.1, clip_mode="two_pass")
    with pytest.warns(UserWarning, match=r"the measuring backward changed the buffers \['calls'\].*recomputed under "
                                         r"activation checkpointing"):
        opt.backward(model(torch.randn(8, 6)))
    assert int(model.calls) == 9  # forward, measuring recompute, stepping recompute: 3 blocks each
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        opt.backward(model(torch.randn(8, 6)))

"""The settings that hold every gradient of a step warn once, at construction or when the clipping changes, naming
the setting and what keeps the saving; the settings that keep it stay silent; ``last_step.grad_bytes_saved`` is the
model's gradient bytes minus the step's peak, measured on real backwards against the standard loop's gradients."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch

import dist_optim

CAP_MB = 0.25  # one Linear(256, 256) per bucket: 8 buckets


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


def one_step(m: torch.nn.Module, opt: dist_optim.InBackwardOptimizer, micro_batches: int = 1) -> None:
    for k in range(micro_batches):
        loss = m(torch.randn(4, 256, generator=torch.Generator().manual_seed(k))).square().mean()
        opt.backward(loss) if opt.clip_mode == "two_pass" and opt.max_grad_norm else loss.backward()
    opt.step()
    opt.zero_grad()


def grad_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


@pytest.mark.parametrize(("options", "match"), [
    (dict(accumulation_steps=4), r"accumulation_steps=4 .*micro-batch 4x larger with activation checkpointing"),
    (dict(max_grad_norm=1.0), r"max_grad_norm=1.0 with clip_mode='exact'.*clip_mode='two_pass'"),
    (dict(bucket_cap_mb=float("inf")), r"bucket_cap_mb=inf covers all.*a bucket_cap_mb below"),
    (dict(bucket_cap_mb=64), r"bucket_cap_mb=64 covers all"),
])
def test_a_setting_that_holds_every_gradient_warns_once_and_saves_nothing(options, match):
    m = model()
    total = f"{grad_bytes(m) / 2**20:.2f} MiB"  # 2.01
    with pytest.warns(UserWarning, match=rf"holds every gradient of the step \({total} of the model's {total}\)"
                      r", so stepping in backward saves no gradient memory") as record:
        opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, **{"bucket_cap_mb": CAP_MB, **options})
    assert sum("saves no gradient memory" in str(w.message) for w in record) == 1
    assert any(re.search(match, str(w.message), re.S) for w in record)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saves no gradient memory")  # once: not again at the steps
        for _ in range(2):
            one_step(m, opt, options.get("accumulation_steps", 1))
    assert opt.last_step.grad_bytes_peak == opt.grad_bytes == grad_bytes(m)
    assert opt.last_step.grad_bytes_saved == 0


@pytest.mark.parametrize("options", [
    dict(), dict(max_grad_norm=1.0, clip_mode="two_pass"), dict(max_grad_norm=1.0, clip_mode="per_parameter"),
    dict(max_grad_norm=1.0, clip_mode="previous_norm"), dict(per_parameter=True, bucket_cap_mb=float("inf")),
    dict(track_grad_norm=True, max_grad_value=0.1),
])
def test_a_setting_that_keeps_the_saving_does_not_warn(options):
    m = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, **{"bucket_cap_mb": CAP_MB, **options})
        for _ in range(2):
            one_step(m, opt)
    largest = 256 * 256 * 4 + 256 * 4  # one Linear: a bucket
    stats = opt.last_step
    assert stats.grad_bytes_peak <= largest
    assert stats.grad_bytes_saved == grad_bytes(m) - stats.grad_bytes_peak >= grad_bytes(m) - largest


def test_exact_clipping_set_later_warns_then_and_only_once():
    m = model()
    opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB)
    one_step(m, opt)
    assert opt.last_step.grad_bytes_saved > 0
    with pytest.warns(UserWarning, match=r"max_grad_norm=0.5 with clip_mode='exact'") as record:
        opt.configure_clipping(max_grad_norm=0.5)
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saves no gradient memory")
        opt.configure_clipping(max_grad_norm=1.0)
        one_step(m, opt)
    assert opt.last_step.grad_bytes_saved == 0
    opt.configure_clipping(clip_mode="two_pass")
    one_step(m, opt)
    assert opt.last_step.grad_bytes_saved > 0


def test_several_causes_are_one_warning():
    with pytest.warns(UserWarning, match=r"accumulation_steps=2.*\n- max_grad_norm=1.0") as record:
        dist_optim.InBackwardOptimizer(model(), torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB,
                                       accumulation_steps=2, max_grad_norm=1.0)
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1


def test_a_standard_step_reports_no_saving():
    m = model()
    opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB)
    with opt.no_step():
        m(torch.randn(4, 256)).sum().backward()
    opt.step()
    assert opt.last_step.grad_bytes_saved == 0


def test_a_grad_scaler_s_exact_overflow_warns_and_per_bucket_does_not():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.warns(UserWarning, match=r"a grad_scaler with overflow='exact'.*overflow='per_bucket'"):
        dist_optim.InBackwardOptimizer(model(), torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB, grad_scaler=scaler)
    m = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB, grad_scaler=scaler,
                                             overflow="per_bucket")
        scaler.scale(m(torch.randn(4, 256)).square().mean()).backward()
        scaler.update()
    assert opt.last_step.grad_bytes_saved > 0


def test_a_tiny_model_s_figure_is_in_bytes():
    with pytest.warns(UserWarning, match=r"\(288 bytes of the model's 288 bytes\)"):
        dist_optim.InBackwardOptimizer(torch.nn.Linear(8, 8), torch.optim.SGD, lr=0.1, max_grad_norm=1.0)


def test_accumulating_with_no_step_by_hand_is_said_at_the_first_step():
    m = model()
    opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB)
    with pytest.warns(UserWarning, match=r"(?s)holds every gradient.*accumulated by the backwards before the "
                      r"one that steps \(opt.no_step\(\), DDP's model.no_sync\(\).*larger micro-batch") as record:
        for _ in range(2):
            with opt.no_step():
                m(torch.randn(4, 256)).sum().backward()
            m(torch.randn(4, 256)).sum().backward()
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1
    assert opt.last_step.grad_bytes_saved == 0


def _ddp_accumulation(ctx, micro: int) -> tuple[list[str], int, int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model(), bucket_cap_mb=CAP_MB)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = dist_optim.InBackwardOptimizer(ddp, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=CAP_MB)
        for step in range(2):
            for k in range(micro):
                with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    ddp(torch.randn(4, 256)).square().mean().backward()
            opt.step()
    said = [str(w.message) for w in record if "saves no gradient memory" in str(w.message)]
    return said, opt.last_step.grad_bytes_saved, opt.grad_bytes


def test_ddp_no_sync_accumulation_is_said_once_and_one_micro_batch_is_not(ranks):
    for said, saved, total in ranks.run(2, _ddp_accumulation, micro=2):
        assert len(said) == 1 and "DDP's model.no_sync()" in said[0] and saved == 0
    for said, saved, total in ranks.run(2, _ddp_accumulation, micro=1):
        assert said == [] and 0 < saved < total


def _fsdp2_accumulation(ctx, micro: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world,))
    m = model()
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = dist_optim.InBackwardOptimizer(m, torch.optim.AdamW, lr=1e-3, bucket_cap_mb=0.1)
        for _ in range(2):
            for k in range(micro):
                m.set_requires_gradient_sync(k == micro - 1)
                m(torch.randn(4, 256)).square().mean().backward()
            opt.step()
    return [str(w.message) for w in record if "saves no gradient memory" in str(w.message)]


def test_fsdp2_accumulation_without_gradient_sync_is_said_once_and_one_micro_batch_is_not(ranks):
    for said in ranks.run(2, _fsdp2_accumulation, micro=2):
        assert len(said) == 1 and "FSDP2's set_requires_gradient_sync(False)" in said[0]
    for said in ranks.run(2, _fsdp2_accumulation, micro=1):
        assert said == []

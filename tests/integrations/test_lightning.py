"""InBackwardCallback against Lightning's standard automatic optimization with fused AdamW: defaults,
accumulate_grad_batches=4 with a short last window, gradient_clip_val by norm and by value, checkpoint and
resume; the logged grad norm; the naive swap with nothing outside the optimizer (the rest: test_naive_swap.py)."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning", reason="the Lightning adapter is tested with lightning installed")
import lightning.pytorch as pl  # noqa: E402
from helpers import assert_same_params, assert_same_state, make_model  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from dist_optim import InBackwardOptimizer  # noqa: E402
from dist_optim.integrations.lightning import InBackwardCallback, TwoPassBackward  # noqa: E402

ADAMW = dict(lr=5e-2, weight_decay=0.1, fused=True)


class Module(pl.LightningModule):
    """``engine``: further engine options of the in-backward optimizer."""

    def __init__(self, in_backward: bool, seed: int = 0, **engine) -> None:
        super().__init__()
        self.net = make_model(seed)
        self.in_backward = in_backward
        self.engine = engine

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.in_backward:
            return InBackwardOptimizer(self.named_parameters(), torch.optim.AdamW, track_grad_norm=True, **self.engine,
                                       **ADAMW)
        return torch.optim.AdamW(self.named_parameters(), **ADAMW)


def loader(n: int = 7) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n * 6, 8, generator=g), torch.randn(n * 6, 1, generator=g)),
                      batch_size=6)


def fit(tmp_path, in_backward: bool, callback: bool = True, epochs: int = 1, ckpt_path=None, seed: int = 0,
        checkpoint=None, module=None, **options):
    module = Module(in_backward, seed) if module is None else module
    callbacks = ([InBackwardCallback()] if callback else []) + ([checkpoint] if checkpoint else [])
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpoint is not None,
        callbacks=callbacks, **options,
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, trainer


def logged_norms(trainer) -> list[float]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return [float(r["grad_norm"]) for r in csv.DictReader(f) if r.get("grad_norm")]


def assert_same_fit(a, b) -> None:
    (module, trainer), (ref, ref_trainer) = a, b
    assert_same_params(module.net, ref.net)
    assert_same_state(trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict())
    assert trainer.global_step == ref_trainer.global_step
    assert logged_norms(trainer) == logged_norms(ref_trainer) and len(logged_norms(trainer)) == trainer.global_step


CASES = {
    "defaults": {},
    "accum4": dict(accumulate_grad_batches=4),
    "clip-norm": dict(gradient_clip_val=1.0),
    "clip-value": dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
    "accum4-clip-norm": dict(accumulate_grad_batches=4, gradient_clip_val=0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_callback_equals_the_standard_fit(tmp_path, case):
    # 7 batches: accumulate_grad_batches=4 steps after batch 4 and on the last one (a window of 3)
    ref = fit(tmp_path / "ref", False, **CASES[case])
    run = fit(tmp_path / "run", True, **CASES[case])
    assert ref[1].global_step == (2 if "accum" in case else 7)
    assert_same_fit(run, ref)
    assert run[1].gradient_clip_val == CASES[case].get("gradient_clip_val")  # given back after fit
    if "clip-norm" in case:
        assert max(logged_norms(ref[1])) > CASES[case]["gradient_clip_val"]  # the clipping bit


class TwoPassModule(TwoPassBackward, Module):
    pass


@pytest.mark.parametrize("case", ["clip-norm", "accum4-clip-norm"])
def test_two_pass_clipping_equals_the_standard_fit(tmp_path, case):
    ref = fit(tmp_path / "ref", False, **CASES[case])
    module = TwoPassModule(True, clip_mode="two_pass", max_grad_norm=1.0)
    run = fit(tmp_path / "run", True, module=module, **CASES[case])
    assert run[1].optimizers[0].clip_mode == "two_pass"
    assert_same_fit(run, ref)
    assert max(logged_norms(ref[1])) > CASES[case]["gradient_clip_val"]  # the clipping bit


def test_two_pass_without_the_mixin_is_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="derive Module from dist_optim.integrations.lightning.TwoPass"):
        fit(tmp_path, True, module=Module(True, clip_mode="two_pass", max_grad_norm=1.0), gradient_clip_val=1.0)


def test_checkpoint_and_resume(tmp_path):
    ref = fit(tmp_path / "ref", False, epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.3)
    save = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    fit(tmp_path / "a", True, epochs=1, checkpoint=save, accumulate_grad_batches=2, gradient_clip_val=0.3)
    module, trainer = fit(tmp_path / "b", True, epochs=2, seed=5, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
                          accumulate_grad_batches=2, gradient_clip_val=0.3)
    assert_same_params(module.net, ref[0].net)
    assert_same_state(trainer.optimizers[0].state_dict(), ref[1].optimizers[0].state_dict())
    assert trainer.global_step == 8 and logged_norms(trainer) == logged_norms(ref[1])[4:]  # the second epoch


def test_an_optimizer_that_does_not_measure_the_norm_gets_a_warning(tmp_path):
    class Untracked(Module):
        def configure_optimizers(self):
            return InBackwardOptimizer(self.parameters(), torch.optim.AdamW, **ADAMW)

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[InBackwardCallback()])
    with pytest.warns(UserWarning, match="logs nothing: the InBackwardOptimizer does not measure"):
        trainer.fit(Untracked(True), loader())


def test_naive_swap_without_accumulation_or_clipping_is_exact(tmp_path):
    ref = fit(tmp_path / "ref", False, callback=False)
    run = fit(tmp_path / "run", True, callback=False)
    assert_same_params(run[0].net, ref[0].net)
    assert run[1].global_step == ref[1].global_step == 7
    # without the adapter, Lightning's step(closure) is torch's: the closure's backward accumulates, step() steps
    assert run[1].optimizers[0].last_step.grad_bytes_peak == 0


def test_with_the_callback_the_closure_s_backward_steps_in_backward(tmp_path):
    module, trainer = fit(tmp_path, True)
    grads = sum(p.numel() * p.element_size() for p in module.parameters())
    assert 0 < trainer.optimizers[0].last_step.grad_bytes_peak <= grads  # stepped bucket by bucket in backward
    assert trainer.optimizers[0].last_step.params_stepped == len(list(module.parameters()))


class ManualAccumulation(Module):
    """Manual optimization, accumulating by hand over 4 batches, as Lightning's docs write it."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__(True)
        self.automatic_optimization = False
        self.strict = strict

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y) / 4)
        if (batch_idx + 1) % 4 == 0:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return InBackwardOptimizer(self.named_parameters(), torch.optim.AdamW, strict=self.strict, **ADAMW)


def _fit_manual(module) -> None:
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, loader(8))


def test_manual_accumulation_with_a_stepping_backward_each_is_warned_or_refused():
    with pytest.warns(UserWarning, match="4 backwards each ran a full optimizer step since the last step"):
        _fit_manual(ManualAccumulation())
    with pytest.raises(RuntimeError, match=r"4 backwards each ran a full optimizer step.*\(strict=True\)"):
        _fit_manual(ManualAccumulation(strict=True))


def test_settings_that_hold_every_gradient_are_said_in_lightning_s_terms(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)InBackwardCallback holds every gradient.*"
                      r"Trainer\(accumulate_grad_batches=2\).*Trainer\(gradient_clip_val=1.0\).*TwoPassBackward"
                      ) as record:
        fit(tmp_path, True, accumulate_grad_batches=2, gradient_clip_val=1.0)
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1


def test_two_pass_clipping_keeps_the_saving_silently(tmp_path):
    class TwoPass(TwoPassBackward, Module):
        pass

    module = TwoPass(True, clip_mode="two_pass", bucket_cap_mb=0.0001)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saves no gradient memory")
        fit(tmp_path, True, module=module, gradient_clip_val=1.0)
    opt = module.optimizers().optimizer
    assert 0 < opt.last_step.grad_bytes_saved < opt.grad_bytes

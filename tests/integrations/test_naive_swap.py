"""The optimizer swapped into a framework without its adapter (dist_optim/_frameworks.py): HF Trainer, Lightning,
accelerate and a torchtune recipe, each with its clipping and accumulation settings, are refused before anything
steps, with the setting and the fix named; with the settings that make it equal (the framework's clipping off and
set on the optimizer, its accumulation mirrored) the run equals the framework's standard run."""

from __future__ import annotations

import os
import threading

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
for framework in ("transformers", "accelerate", "lightning", "torchtune"):
    pytest.importorskip(framework, reason="the naive swap is tested inside each framework, installed for the tests")
import test_hf_accelerate as acc  # noqa: E402
import test_hf_trainer as hf  # noqa: E402
import test_lightning as light  # noqa: E402
import test_torchtune as tt  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from helpers import assert_same_params, assert_same_state, make_model  # noqa: E402
from torchtune import training  # noqa: E402
from torchtune.recipe_interfaces import FTRecipeInterface  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import dist_optim  # noqa: E402

FIX = r".*\. Or use dist_optim\.integrations\."


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    acc.reset_accelerate()


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_untouched(model: torch.nn.Module, before: list[torch.Tensor]) -> None:
    """Nothing stepped, and no gradient of the refused backward is left to be added to a later one."""
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None


# -- HF Trainer ------------------------------------------------------------------------------------------------------
HF_REFUSED = {
    "defaults": ({}, r"TrainingArguments\(max_grad_norm=1\.0\) clips .*it has max_grad_norm=None.*set "
                     r"TrainingArguments\(max_grad_norm=0\) and give the optimizer max_grad_norm=1\.0"),
    "accum4": (dict(gradient_accumulation_steps=4, max_grad_norm=0.0),
               r"TrainingArguments\(gradient_accumulation_steps=4\) accumulates .*accumulation_steps=1\): pass "
               r"accumulation_steps=4 to the optimizer"),
}


@pytest.mark.parametrize("built", ["by the Trainer", "outside"])
@pytest.mark.parametrize("case", list(HF_REFUSED))
def test_hf_trainer_refuses_before_anything_steps(tmp_path, case, built):
    """Built by the Trainer (optimizer_cls_and_kwargs): refused at construction; passed in (optimizers=): at the
    first backward, before its first step, and at the next run's too."""
    options, message = HF_REFUSED[case]
    model = hf.tiny_llama()
    before = snapshot(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, **options)
    if built == "outside":
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **hf.FUSED_ADAMW)
        trainer = Trainer(model=model, args=args, train_dataset=hf.dataset(), optimizers=(opt, None))
    else:
        trainer = Trainer(model=model, args=args, train_dataset=hf.dataset(),
                          optimizer_cls_and_kwargs=(dist_optim.in_backward(torch.optim.AdamW), hf.FUSED_ADAMW))
    for _ in range(2):  # and again when retried with the same optimizer
        with pytest.raises(ValueError, match=message + FIX + r"hf_trainer\.InBackwardTrainer"):
            trainer.train()
        assert_untouched(model, before)


class BackwardOnAnotherThread(Trainer):
    """Runs each backward on a thread of its own, as autograd runs a CUDA backward's hooks on its device threads:
    the Trainer is not on that thread's stack."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = model(**inputs).loss
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
        return loss.detach()


def test_hf_trainer_unseen_in_backward_is_refused_at_the_first_step(tmp_path):
    """Where the hooks cannot see the Trainer, its first optimizer.step() can: refused there, saying that one
    in-backward step has run."""
    model = hf.tiny_llama()
    before = snapshot(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **hf.FUSED_ADAMW)
    trainer = BackwardOnAnotherThread(model=model, args=args, train_dataset=hf.dataset(), optimizers=(opt, None))
    with pytest.raises(ValueError, match=r"standard run \(seen at the first step\(\) call, after the in-backward step"
                                         r".*TrainingArguments\(max_grad_norm=1\.0\) clips"):
        trainer.train()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))  # the one step that ran


@pytest.mark.parametrize(
    ("ref_options", "options", "engine"),
    [({}, dict(max_grad_norm=0.0), dict(max_grad_norm=1.0)),  # the default max_grad_norm=1.0, on the optimizer
     (dict(max_grad_norm=0.3, gradient_accumulation_steps=4), dict(max_grad_norm=0.0, gradient_accumulation_steps=4),
      dict(max_grad_norm=0.3, accumulation_steps=4)),
     (dict(max_grad_norm=0.0), dict(max_grad_norm=0.0), {})],
    ids=["clip-on-optimizer", "accum4-clip-on-optimizer", "nothing-outside"],
)
def test_hf_trainer_equal_with_clipping_on_the_optimizer(tmp_path, ref_options, options, engine):
    """Equal to the standard Trainer; only its logged grad_norm is wrong (computed from .grad after the step), which
    a warning says. With clipping within 1e-6: the norms are summed in another order (see test_hf_trainer)."""
    ref, ref_norms = hf.train(Trainer, tmp_path, **ref_options)
    cls = dist_optim.in_backward(torch.optim.AdamW, **engine)
    with pytest.warns(UserWarning, match=r"the Trainer logs grad_norm .* it will log 0\.0.*InBackwardTrainer"):
        run, norms = hf.train(Trainer, tmp_path, optimizer_cls_and_kwargs=(cls, hf.FUSED_ADAMW), **options)
    for (name, p), q in zip(run.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6 if "max_grad_norm" in engine else 0, msg=name)
    assert run.state.global_step == ref.state.global_step and norms[0] == 0.0
    if engine.get("max_grad_norm"):
        assert max(ref_norms) > engine["max_grad_norm"]  # the clipping bit


# -- Lightning ---------------------------------------------------------------------------------------------------------
LIGHTNING_REFUSED = {
    "clip-norm": (dict(gradient_clip_val=1.0), {},
                  r"Trainer\(gradient_clip_val=1\.0\) clips the gradients after backward.*set gradient_clip_val=None "
                  r"and give the optimizer max_grad_norm=1\.0"),
    "clip-norm-mirrored": (dict(gradient_clip_val=1.0), dict(max_grad_norm=1.0),
                           r"it has max_grad_norm=1\.0\): set gradient_clip_val=None and keep the optimizer's "
                           r"clipping"),
    "clip-value": (dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"), {},
                   r"Trainer\(gradient_clip_val=0\.05, gradient_clip_algorithm='value'\) clamps .*give the optimizer "
                   r"max_grad_value=0\.05"),
    "accum4": (dict(accumulate_grad_batches=4), {}, r"Trainer\(accumulate_grad_batches=4\) accumulates .*pass "
                                                r"accumulation_steps=4"),
}


@pytest.mark.parametrize("case", list(LIGHTNING_REFUSED))
def test_lightning_refuses_at_configure_optimizers(tmp_path, case):
    options, engine, message = LIGHTNING_REFUSED[case]
    module = light.Module(True, **engine)
    before = snapshot(module)
    with pytest.raises(ValueError, match=message + FIX + r"lightning\.InBackwardCallback"):
        light.fit(tmp_path, True, callback=False, module=module, **options)
    assert_untouched(module, before)


@pytest.mark.parametrize(
    ("options", "engine"),
    [(dict(gradient_clip_val=1.0), dict(max_grad_norm=1.0)),
     (dict(accumulate_grad_batches=4, gradient_clip_val=0.3), dict(accumulation_steps=4, max_grad_norm=0.3))],
    ids=["clip-on-optimizer", "accum4-clip-on-optimizer"],
)
def test_lightning_equal_with_clipping_on_the_optimizer(tmp_path, options, engine):
    """Bitwise the standard fit, including the short last window of 3 batches (stepped by step(closure))."""
    ref = light.fit(tmp_path / "ref", False, callback=False, **options)
    run = light.fit(tmp_path / "run", True, callback=False, module=light.Module(True, **engine),
                    **{**options, "gradient_clip_val": None})
    assert_same_params(run[0].net, ref[0].net)
    assert_same_state(run[1].optimizers[0].state_dict(), ref[1].optimizers[0].state_dict())
    assert run[1].global_step == ref[1].global_step


# -- accelerate ----------------------------------------------------------------------------------------------------
def test_accelerate_accumulation_is_refused_at_the_first_backward():
    model = make_model()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Accelerator\(gradient_accumulation_steps=4\) marks this micro-batch .*pass "
                                         r"accumulation_steps=4" + FIX + r"hf_accelerate\.InBackwardAccelerator"):
        acc.run(Accelerator, True, accum=4, model=model)
    assert_untouched(model, before)


def test_accelerate_accumulation_mirrored_is_equal():
    ref, ref_opt, _ = acc.run(Accelerator, False, accum=4)
    acc.reset_accelerate()
    model, opt, _ = acc.run(Accelerator, True, accum=4, accumulation_steps=4)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def value_clipping_loop(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A plain accelerate loop that clamps after backward, as accelerate's docs write it."""
    accelerator = Accelerator(cpu=True)
    model, opt, dl = accelerator.prepare(model, opt, acc.loader())
    for x, y in dl:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_value_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()


def norm_clipping_loop(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The same loop clipping by norm; returns the norms accelerate reported."""
    accelerator = Accelerator(cpu=True)
    model, opt, dl = accelerator.prepare(model, opt, acc.loader())
    norms = []
    for x, y in dl:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("max_grad_value", [0.05, None], ids=["optimizer-clamps", "optimizer-does-not"])
def test_accelerate_clip_grad_value_in_the_loop_is_refused_before_anything_steps(max_grad_value):
    # accelerate has no clipping setting: the loop's own calls are read from its code. Its clip_grad_value_ after an
    # in-backward step would fail inside torch on the empty gradient list: refused at the first backward instead.
    model = make_model()
    before = snapshot(model)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, max_grad_value=max_grad_value, **acc.ADAMW)
    fix = ("Drop the call \\(the optimizer's max_grad_value=0.05 clamps inside backward\\)" if max_grad_value else
           "Drop the call and give the optimizer max_grad_value=<its clip_value>")
    with pytest.raises(ValueError, match=r"calls accelerator\.clip_grad_value_, which runs after backward.*"
                                         r"nested_tensorlist.*" + fix + r" \(read from the loop's code.*" + FIX
                                         + r"hf_accelerate\.InBackwardAccelerator"):
        value_clipping_loop(model, opt)
    assert_untouched(model, before)


def test_accelerate_clip_grad_norm_in_the_loop_is_refused_when_the_optimizer_does_not_clip():
    model = make_model()
    before = snapshot(model)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **acc.ADAMW)
    with pytest.raises(ValueError, match=r"calls accelerator\.clip_grad_norm_, .*clips nothing and returns 0\.0\): "
                                         r"give the optimizer max_grad_norm=<its max_norm> and drop the call"
                                         + FIX + r"hf_accelerate\.InBackwardAccelerator"):
        norm_clipping_loop(model, opt)
    assert_untouched(model, before)


def test_accelerate_clip_grad_norm_in_the_loop_with_the_optimizer_clipping_warns_and_equals_the_standard_loop():
    ref = make_model()
    ref_norms = norm_clipping_loop(ref, torch.optim.AdamW(ref.parameters(), **acc.ADAMW))
    acc.reset_accelerate()
    model = make_model()
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, max_grad_norm=1.0, **acc.ADAMW)
    with pytest.warns(UserWarning, match=r"calls accelerator.clip_grad_norm_, .*returns 0.0: the optimizer's "
                                         r"max_grad_norm clips inside backward"):
        norms = norm_clipping_loop(model, opt)
    assert all(n.item() == 0.0 for n in norms) and any(n.item() > 1.0 for n in ref_norms)  # the reference clipped
    assert_same_params(model, ref)


# -- torchtune ---------------------------------------------------------------------------------------------------------
class Recipe(FTRecipeInterface):
    """full_finetune_single_device's training loop in small, with its settings' attribute names. ``multiplier``:
    the loop adapted as docs/frameworks.md says (the scale set before the window's last backward)."""

    def __init__(self, accum: int, clip: float | None, multiplier: bool = False) -> None:
        self._gradient_accumulation_steps = accum
        self._clip_grad_norm = clip
        self._optimizer_in_bwd = False
        self._multiplier = multiplier
        self.norms: list[torch.Tensor] = []

    def setup(self, in_backward: bool, **engine) -> None:
        self._model = tt.tiny_llama()
        if in_backward:
            self._optimizer = dist_optim.InBackwardOptimizer(self._model, torch.optim.AdamW, **engine, **tt.ADAMW)
        else:
            self._optimizer = torch.optim.AdamW(self._model.named_parameters(), **tt.ADAMW)

    def train(self, data: list[dict[str, torch.Tensor]]) -> None:
        num_tokens = 0
        for idx, batch in enumerate(data):
            current_num_tokens = (batch["labels"] != tt.IGNORE).sum()
            num_tokens += current_num_tokens
            if self._multiplier and (idx + 1) % self._gradient_accumulation_steps == 0:
                self._optimizer.set_grad_multiplier(1 / num_tokens)
            (tt.loss_step(self._model, batch) * current_num_tokens).backward()
            if (idx + 1) % self._gradient_accumulation_steps == 0:
                training.scale_grads(self._model, 1 / num_tokens)
                if self._clip_grad_norm is not None:
                    self.norms.append(torch.nn.utils.clip_grad_norm_(self._model.parameters(),
                                                                     max_norm=float(self._clip_grad_norm)))
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                num_tokens = 0


TORCHTUNE_REFUSED = {
    "scale": (dict(accum=1, clip=None), {}, r"Recipe\.train scales the gradients by 1 / num_tokens after backward "
                                            r"\(training\.scale_grads\).*opt\.set_grad_multiplier\(1 / num_tokens\)"),
    "clip": (dict(accum=1, clip=1.0, multiplier=True), {},
             r"clip_grad_norm=1\.0 clips the gradients after backward.*it has max_grad_norm=None\): set "
             r"clip_grad_norm: null in the config and give the optimizer max_grad_norm=1\.0"),
    "accum4": (dict(accum=4, clip=None, multiplier=True), {},
               r"gradient_accumulation_steps=4 accumulates .*pass accumulation_steps=4"),
}


@pytest.mark.parametrize("case", list(TORCHTUNE_REFUSED))
def test_torchtune_recipe_refuses_before_anything_steps(case):
    """Clipping and accumulation are refused when the recipe builds the optimizer; the missing scale at the first
    backward (the multiplier may be set any time before it)."""
    settings, engine, message = TORCHTUNE_REFUSED[case]
    recipe = Recipe(**settings)
    with pytest.raises(ValueError, match=message + r".*\. Or use the recipe loop of docs/frameworks\.md#torchtune"):
        recipe.setup(True, **engine)
        before = snapshot(recipe._model)
        recipe.train(tt.batches(4))
    if case == "scale":
        assert_untouched(recipe._model, before)


def test_torchtune_recipe_equal_when_adapted():
    """Scale by the multiplier, clipping and accumulation on the optimizer: bitwise the recipe's run (two full
    windows)."""
    data = tt.batches(8)
    ref = Recipe(accum=4, clip=0.5)
    ref.setup(False)
    ref.train(data)
    run = Recipe(accum=4, clip=None, multiplier=True)
    run.setup(True, accumulation_steps=4, max_grad_norm=0.5)
    run.train(data)
    assert_same_params(run._model, ref._model)
    assert_same_state(run._optimizer.state_dict(), ref._optimizer.state_dict())
    assert max(ref.norms) > 0.5  # the clipping bit

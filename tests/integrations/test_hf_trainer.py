"""InBackwardTrainer against HF Trainer with the same fused AdamW on a tiny Llama built from a config (no hub):
defaults (max_grad_norm=1.0), accumulation 4 with a short last window, no clipping, checkpoint and resume; the
logged grad_norm. The optimizer class alone in a plain Trainer: test_naive_swap.py."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="the HF Trainer adapter is tested with transformers installed")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from helpers import assert_same_state  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import dist_optim  # noqa: E402
from dist_optim.integrations.hf_trainer import InBackwardTrainer  # noqa: E402

SAMPLES = 14  # batch 2: 7 micro-batches, so accumulation 4 ends with a window of 3


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (SAMPLES, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def train(trainer_cls, tmp_path, resume: str | None = None, optimizer_cls_and_kwargs=None, **options):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    defaults = dict(per_device_train_batch_size=2, num_train_epochs=1, learning_rate=5e-2, logging_steps=1,
                    report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
    args = TrainingArguments(output_dir=str(tmp_path), **{**defaults, **options})
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=dataset(),
                          optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
    trainer.train(resume_from_checkpoint=resume)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return trainer, norms


def assert_same_run(a, b, exact: bool = True) -> None:
    """Bitwise: parameters, optimizer state and logged norms (the optimizer combines the per-tensor norms in
    ``model.parameters()`` order, as the Trainer's ``clip_grad_norm_`` does). ``exact=False``: within 1e-6."""
    (trainer, norms), (ref, ref_norms) = a, b
    for (name, p), q in zip(trainer.model.named_parameters(), ref.model.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    if exact:
        assert_same_state(trainer.optimizer.state_dict(), ref.optimizer.state_dict())
    assert len(norms) == ref.state.global_step == len(ref_norms)
    assert norms == ref_norms if exact else norms == pytest.approx(ref_norms, rel=1e-6)


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_accumulation_steps": 4}, {"max_grad_norm": 0.0},
     {"gradient_accumulation_steps": 4, "max_grad_norm": 0.3}],
    ids=["defaults", "accum4", "no-clip", "accum4-clip0.3"],
)
def test_adapter_equals_the_standard_trainer(tmp_path, options):
    ref = train(Trainer, tmp_path, **options)
    assert ref[0].args.optim == "adamw_torch_fused"
    run = train(InBackwardTrainer, tmp_path, **options)
    assert isinstance(run[0].optimizer.optimizer, dist_optim.InBackwardOptimizer)
    assert_same_run(run, ref)
    if options.get("max_grad_norm", 1.0):
        assert max(ref[1]) > options.get("max_grad_norm", 1.0)  # the clipping bit


@pytest.mark.parametrize("options", [{}, {"gradient_accumulation_steps": 4, "max_grad_norm": 0.3}],
                         ids=["defaults", "accum4-clip0.3"])
def test_two_pass_clipping_equals_the_standard_trainer(tmp_path, options):
    ref = train(Trainer, tmp_path, **options)
    run = train(functools.partial(InBackwardTrainer, in_backward_options={"clip_mode": "two_pass"}), tmp_path,
                **options)
    opt = run[0].optimizer.optimizer
    assert opt.clip_mode == "two_pass" and opt.max_grad_norm == options.get("max_grad_norm", 1.0)
    assert_same_run(run, ref)
    assert max(ref[1]) > options.get("max_grad_norm", 1.0)  # the clipping bit


def test_checkpoint_and_resume(tmp_path):
    ref = train(Trainer, tmp_path / "ref", gradient_accumulation_steps=2)
    train(InBackwardTrainer, tmp_path / "a", gradient_accumulation_steps=2, save_strategy="steps", save_steps=2)
    resumed = train(InBackwardTrainer, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"),
                    gradient_accumulation_steps=2)
    assert resumed[0].state.global_step == ref[0].state.global_step == 4
    assert_same_run(resumed, ref)  # the log history holds the checkpoint's two steps too


# what the default optim ("adamw_torch_fused") builds, given by hand
FUSED_ADAMW = {"lr": 5e-2, "betas": (0.9, 0.999), "eps": 1e-8, "fused": True}


def test_the_class_factory_works_as_optimizer_cls_and_kwargs(tmp_path):
    ref = train(Trainer, tmp_path, max_grad_norm=0.0)
    cls = dist_optim.in_backward(torch.optim.AdamW, track_grad_norm=True)
    run = train(InBackwardTrainer, tmp_path, optimizer_cls_and_kwargs=(cls, FUSED_ADAMW), max_grad_norm=0.0)
    assert_same_run(run, ref)


def test_a_partial_of_the_optimizer_names_the_class_factory(tmp_path):
    # the Trainer calls a non-class optimizer_cls as a factory without arguments
    partial = functools.partial(dist_optim.InBackwardOptimizer, optimizer_class=torch.optim.AdamW)
    with pytest.raises(TypeError, match=r"got no params.*dist_optim.in_backward\(torch.optim.AdamW"):
        train(Trainer, tmp_path, max_grad_norm=0.0, optimizer_cls_and_kwargs=(partial, FUSED_ADAMW))


def test_an_optimizer_that_cannot_step_in_backward_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = InBackwardTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                                optimizer_cls_and_kwargs=(functools.partial(torch.optim.AdamW), {}))
    with pytest.raises(NotImplementedError, match=r"optimizer_cls_and_kwargs gives functools.partial.*cls\(params"):
        trainer.create_optimizer()


def test_settings_that_hold_every_gradient_are_said_in_the_trainer_s_terms(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)InBackwardTrainer holds every gradient.*gradient_accumulation_steps=4 .*"
                      r"per_device_train_batch_size 4x larger.*max_grad_norm=1.0 .*in_backward_options="
                      r"\{\"clip_mode\": \"two_pass\"\}") as record:
        trainer, _ = train(InBackwardTrainer, tmp_path, gradient_accumulation_steps=4)
    assert len([w for w in record if "saves no gradient memory" in str(w.message)]) == 1
    assert dist_optim.integrations.hf_trainer.unwrap(trainer.optimizer).last_step.grad_bytes_saved == 0


def test_two_pass_without_accumulation_keeps_the_saving_silently(tmp_path):
    trainer_cls = functools.partial(InBackwardTrainer, in_backward_options={"clip_mode": "two_pass",
                                                                            "bucket_cap_mb": 0.001})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saves no gradient memory")
        trainer, _ = train(trainer_cls, tmp_path)
    opt = dist_optim.integrations.hf_trainer.unwrap(trainer.optimizer)
    assert 0 < opt.last_step.grad_bytes_saved < opt.grad_bytes

"""torchtune: its recipe loop (``loss * num_tokens``, ``scale_grads(1 / num_tokens)``, ``clip_grad_norm_``) with
fused AdamW against the same loop in backward with ``set_grad_multiplier``, on a tiny torchtune Llama built from
its component builder (no download); ``OptimizerInBackwardWrapper`` state dicts converted both ways with an exact
resume; ``build_optimizer`` through torchtune's ``config.instantiate``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtune", reason="the torchtune adapter is tested with torchtune installed")
from helpers import assert_same_params, assert_same_state  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchtune import config as tt_config  # noqa: E402
from torchtune import training
from torchtune.models.llama2 import llama2  # noqa: E402

from dist_optim import InBackwardOptimizer  # noqa: E402
from dist_optim.integrations.torchtune import (  # noqa: E402
    build_optimizer,
    from_torchtune_state_dict,
    to_torchtune_state_dict,
)

ADAMW = dict(lr=2e-2, weight_decay=0.01, fused=True)
IGNORE = -100


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama2(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=16, max_seq_len=32)


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 64, (2, 10), generator=g)
        labels = tokens.roll(-1, dims=1)
        labels[torch.rand(labels.shape, generator=g) < 0.3] = IGNORE  # a different token count per batch
        out.append({"tokens": tokens, "labels": labels})
    return out


def loss_step(model, batch) -> torch.Tensor:
    logits = model(batch["tokens"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)


def recipe(model, data, accum, clip, in_backward: bool):
    """full_finetune_single_device's loop; in backward the scale is set before the window's last backward, and a
    short last window is finished by ``opt.step()`` (the standard side scales, clips and steps it too)."""
    if in_backward:
        opt = InBackwardOptimizer(model, torch.optim.AdamW, accumulation_steps=accum, max_grad_norm=clip, **ADAMW)
    else:
        opt = torch.optim.AdamW(model.named_parameters(), **ADAMW)
    norms, num_tokens = [], 0
    for idx, batch in enumerate(data):
        current_num_tokens = (batch["labels"] != IGNORE).sum()
        num_tokens += current_num_tokens
        last = (idx + 1) % accum == 0 or idx + 1 == len(data)
        if in_backward and last:
            opt.set_grad_multiplier(1 / num_tokens)
        (loss_step(model, batch) * current_num_tokens).backward()
        if last:
            if in_backward:
                opt.step()  # a no-op after an in-backward step; steps a short last window
                norms.append(opt.grad_norm)
            else:
                training.scale_grads(model, 1 / num_tokens)
                if clip is not None:
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float(clip)))
                opt.step()
                opt.zero_grad(set_to_none=True)
            num_tokens = 0
    return opt, norms


@pytest.mark.parametrize(("accum", "clip"), [(1, None), (4, None), (1, 1.0), (4, 0.5)])
def test_recipe_loop_in_backward_equals_the_recipe(accum, clip):
    data = batches(7)  # accum=4: windows of 4 and 3
    ref = tiny_llama()
    ref_opt, ref_norms = recipe(ref, data, accum, clip, in_backward=False)
    model = tiny_llama()
    opt, norms = recipe(model, data, accum, clip, in_backward=True)
    assert_same_params(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    if clip is not None:
        assert len(norms) == len(ref_norms) and all(torch.equal(a, b) for a, b in zip(norms, ref_norms))
        assert max(ref_norms) > clip  # the clipping bit


def torchtune_in_backward(model):
    """What torchtune's recipes do with optimizer_in_bwd=True."""
    optim_dict = {p: torch.optim.AdamW([p], **ADAMW) for p in model.parameters()}
    training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
    return training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)


def train_per_batch(model, data) -> None:
    for batch in data:
        loss_step(model, batch).backward()


def test_torchtune_checkpoint_resumes_in_backward_exactly_and_back():
    data = batches(6)
    ref = tiny_llama()
    ref_wrapper = torchtune_in_backward(ref)
    train_per_batch(ref, data[:3])
    saved = copy.deepcopy(ref_wrapper.state_dict())
    saved_model = copy.deepcopy(ref.state_dict())
    train_per_batch(ref, data[3:])

    # torchtune -> dist_optim, then three more steps
    model = tiny_llama()
    model.load_state_dict(saved_model)
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    opt.load_state_dict(from_torchtune_state_dict(saved, opt))
    train_per_batch(model, data[3:])
    assert_same_params(model, ref)

    # dist_optim -> torchtune, then three more steps there
    back = tiny_llama()
    back.load_state_dict(model.state_dict())
    wrapper = torchtune_in_backward(back)
    # a copy, as a checkpoint file would be: like torch's state_dict(), the conversion refers to the live state
    wrapper.load_state_dict(copy.deepcopy(to_torchtune_state_dict(opt)))
    train_per_batch(back, data[:3])
    train_per_batch(model, data[:3])
    assert_same_params(back, model)
    ours = to_torchtune_state_dict(opt)
    for name, entry in wrapper.state_dict().items():
        assert_same_state(entry, ours[name])


def test_conversion_errors_name_the_fix():
    model = tiny_llama()
    opt = InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    converted = to_torchtune_state_dict(opt)
    extra = {k: v for k, v in converted.items() if k != "output.weight"}
    extra["lm_head.weight"] = converted["output.weight"]
    with pytest.raises(ValueError, match=r"missing \['output.weight'\], unexpected \['lm_head.weight'\]"):
        from_torchtune_state_dict(extra, opt)
    with pytest.raises(ValueError, match="not a torchtune OptimizerInBackwardWrapper state dict"):
        from_torchtune_state_dict({n: {} for n in converted}, opt)
    with pytest.raises(ValueError, match=r"torch optimizer state dict.*load it with optimizer.load_state_dict"):
        from_torchtune_state_dict(opt.state_dict(), opt)
    unnamed = InBackwardOptimizer(list(tiny_llama().parameters()), torch.optim.AdamW, **ADAMW)
    with pytest.raises(ValueError, match="build it from model.named_parameters"):
        to_torchtune_state_dict(unnamed)


def test_build_optimizer_through_torchtune_config_instantiate():
    cfg = OmegaConf.create({"_component_": "dist_optim.integrations.torchtune.build_optimizer",
                            "optimizer_class": "torch.optim.AdamW", "lr": 2e-2, "fused": True, "max_grad_norm": 1.0})
    model = tiny_llama()
    opt = tt_config.instantiate(cfg, model)
    assert isinstance(opt, InBackwardOptimizer) and opt.max_grad_norm == 1.0 and opt.param_groups[0]["fused"]
    with pytest.raises(ValueError, match="names no importable class"):
        build_optimizer(tiny_llama(), "torch.optim.NoSuchOptimizer")


def test_grad_multiplier_is_checked():
    opt = InBackwardOptimizer(tiny_llama(), torch.optim.SGD, lr=0.1)
    for bad in (float("nan"), torch.ones(2), torch.tensor(3), "x"):
        with pytest.raises(ValueError, match="grad_multiplier must be"):
            opt.set_grad_multiplier(bad)
    opt.set_grad_multiplier(0.5)
    opt.configure_clipping(max_grad_norm=1.0)  # keeps the multiplier
    assert opt.grad_multiplier == 0.5
    opt.set_grad_multiplier(None)
    assert opt.grad_multiplier is None

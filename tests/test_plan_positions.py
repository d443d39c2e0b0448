"""dist_optim.plan refuses a job that cannot run: sequences longer than the model's learned positions (the real
forward would index past its position embedding; fake tensors would plan it without a word)."""

from __future__ import annotations

import pytest
import torch

import dist_optim
from launch.gpt import GPT


def _plan(seq: int, **kw):
    return dist_optim.plan(lambda: GPT(256, 32, 2, 2, 64), lambda: (torch.randint(0, 256, (2, seq)),) * 2,
                           lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()),
                           lr=1e-3, **kw)


@pytest.mark.parametrize("layout", [{}, {"parallel": "ddp", "world_size": 2}])
def test_sequences_above_the_learned_positions_are_refused(layout):
    with pytest.raises(ValueError, match="sequences are 33 tokens, above the model's 32 learned positions .* make "
                                         "them 32 tokens or fewer"):
        _plan(33, **layout)
    assert _plan(32, **layout).in_backward.peak_bytes > 0


def test_rotary_positions_have_no_such_limit():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, vocab_size=128, max_position_embeddings=16)
    p = dist_optim.plan(lambda: transformers.LlamaForCausalLM(config), lambda: torch.randint(0, 128, (1, 24)),
                        lambda m, ids: m(input_ids=ids, labels=ids).loss, lr=1e-3)
    assert p.in_backward.peak_bytes > 0

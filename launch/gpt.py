"""A small GPT-style causal language model: token and position embeddings, pre-norm blocks (causal self-attention
through ``F.scaled_dot_product_attention``, then an MLP), a final norm and a head tied to the embedding or not.

``blocks`` is a ``ModuleList`` of :class:`Block` so that FSDP2 can shard one block at a time. The first
``checkpoint_blocks`` blocks recompute their forward in backward (``torch.utils.checkpoint``, non-reentrant) instead
of keeping their activations: the same values, bit for bit, for one more forward of those blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "loss_fn", "run_block"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 tie_weights: bool = True, checkpoint_blocks: int = 0) -> None:
        super().__init__()
        if not 0 <= checkpoint_blocks <= n_layer:
            raise ValueError(f"checkpoint_blocks must be in [0, n_layer={n_layer}], got {checkpoint_blocks}")
        self.block_size = block_size
        self.checkpoint_blocks = checkpoint_blocks
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):  # GPT-2's scaled residual init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for byte ids ``idx`` of shape ``(batch, time)``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, i < self.checkpoint_blocks)
        return self.head(self.ln_f(x))


def run_block(block: nn.Module, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """``block(x)``; ``checkpointed``: its activations recomputed in backward instead of kept."""
    return checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def from_config(cfg: dict, vocab_size: int) -> GPT:
    """The model a run's configuration describes (``TrainConfig.to_dict()``, or the run's ``config.json``): the one
    builder the trainer and the tests that read its checkpoints share."""
    model = GPT(vocab_size, cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["tie_weights"],
                cfg.get("checkpoint_blocks", 0))  # a run's config.json from before the option: none
    return cast(model, getattr(torch, cfg.get("param_dtype", "float32")))


def cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its parameters in ``dtype``, tied ones still tied. Not ``model.to(dtype)``: that swaps
    tensors in place, which the planner's fake tensors refuse."""
    if dtype == torch.float32:
        return model
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    return model

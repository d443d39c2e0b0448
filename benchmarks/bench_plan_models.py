"""The memory planner on models besides the trainer's GPT (issue 34): planned against measured, both loops and the
saving, one process on CPU.

    python -m benchmarks.bench_plan_models            # every row: a minute or two
    python -m benchmarks.bench_plan_models --quick    # the small rows

Rows: a ResNet (convolutions and BatchNorm; fp32 and bf16 parameters; 64 channels at batch 2, where the gradients
set the peak, and 16 at batch 32, where the activations do), ``nn.TransformerEncoder``
(its layers built by ``copy.deepcopy``), a mixture of experts whose experts run on a fixed share of the tokens
(routing by top-k without data-dependent shapes), and the GPT stepped by the low-bit classes (torchao ``AdamW8bit``,
``AdamW4bit``, bitsandbytes ``AdamW8bit``: planned from their own state, ``dist_optim._planner._lowbit``; torchao's
``AdamW8bit`` also on 4 Linear layers of one shape, which its compiled step compiles once), each
measured as ``bench_plan`` measures (the planner's own ``Job``, warm, the allocator's peak of one step). The low-bit
rows also print each class's step temporaries per element (``STEP_BYTES``), measured on one parameter.
"""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import torch
from torch import nn

from benchmarks import harness as h
from benchmarks.bench_plan import _builders, compare_job, print_rows
from dist_optim import plan
from dist_optim._planner import _outside
from dist_optim._planner._step import LOOPS, Job

CLASSES = 10
IMAGE = 32  # pixels a side


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, a strided 1x1 shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    """A small ResNet for 32 x 32 images: a stem, three stages of two blocks, global pooling, a linear head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, 2 * width, 4 * width]
        blocks: list[nn.Module] = []
        for i, c in enumerate(chans):
            cin = chans[max(0, i - 1)] if i else width
            blocks += [Block(cin, c, 1 if i == 0 else 2), Block(c, c, 1)]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(chans[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class MoE(nn.Module):
    """A transformer-ish MoE layer stack: each token's top-1 expert is chosen by a learned router, and every expert
    runs on all tokens weighted by its gate (dense dispatch: shapes that do not depend on the routing)."""

    def __init__(self, dim: int = 64, experts: int = 4, layers: int = 2, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.routers = nn.ModuleList(nn.Linear(dim, experts) for _ in range(layers))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                 nn.Linear(4 * dim, dim)) for _ in range(experts))
                                     for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for router, experts in zip(self.routers, self.experts):
            gates = torch.softmax(router(x), -1)
            top = gates * (gates == gates.amax(-1, keepdim=True))  # top-1, its weight kept: no data-dependent shape
            x = x + sum(top[..., e:e + 1] * expert(x) for e, expert in enumerate(experts))
        return self.out(x)


def _in_dtype(build: Any, dtype: torch.dtype) -> Any:
    def model_fn() -> nn.Module:
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # fake parameters cannot be converted after: built in the dtype
        try:
            return build()
        finally:
            torch.set_default_dtype(before)
    return model_fn


def resnet(batch: int, dtype: torch.dtype, width: int = 16) -> tuple[Any, Any, Any]:
    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, IMAGE, IMAGE, dtype=dtype), torch.randint(0, CLASSES, (batch,))

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(b[0]).float(), b[1])
    return _in_dtype(lambda: ResNet(width), dtype), batch_fn, loss


def encoder(batch: int = 2, seq: int = 32, dim: int = 256) -> tuple[Any, Any, Any]:
    def model_fn() -> nn.Module:
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def batch_fn() -> torch.Tensor:
        return torch.randn(batch, seq, dim)
    return model_fn, batch_fn, lambda model, x: model(x).square().mean()


def mlp(batch: int = 8, dim: int = 512, depth: int = 4) -> tuple[Any, Any, Any]:
    """``depth`` Linear(dim, dim) + Tanh: two parameter shapes, so a compiled low-bit step (torchao's, one graph per
    shape) compiles twice, where the GPT's take ten."""
    def model_fn() -> nn.Module:
        return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(dim, dim), nn.Tanh())])

    return model_fn, lambda: torch.randn(batch, dim), lambda model, x: model(x).square().mean()


def moe(batch: int = 2, seq: int = 32, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, Any]:
    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 256, (batch, seq)), torch.randint(0, 256, (batch, seq))

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(b[0]).flatten(0, 1).float(), b[1].flatten())
    return _in_dtype(lambda: MoE(dim=128), dtype), batch_fn, loss


def low_bit(name: str) -> type[torch.optim.Optimizer]:
    """A low-bit class by name (``torchao.AdamW8bit``, ``torchao.AdamW4bit``, ``bitsandbytes.AdamW8bit``)."""
    package, cls = name.split(".")
    if package == "torchao":
        import torchao.optim as optim
    else:
        import bitsandbytes.optim as optim  # type: ignore[no-redef]
    return getattr(optim, cls)


SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-3})
GPT = (2, 4, 256, 32, 4)
# label -> (builders, (optimizer class or low-bit name, its kwargs), engine options)
ROWS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "resnet-64, fp32, batch 2, AdamW": (lambda: resnet(2, torch.float32, 64), ADAMW, {"bucket_cap_mb": 0.5}),
    "resnet-64, bf16, batch 2, AdamW": (lambda: resnet(2, torch.bfloat16, 64), ADAMW, {"bucket_cap_mb": 0.5}),
    "resnet, fp32, batch 32, SGD": (lambda: resnet(32, torch.float32), SGD, {}),
    "resnet, bf16, batch 32, AdamW": (lambda: resnet(32, torch.bfloat16), ADAMW, {}),
    "TransformerEncoder, fp32": (encoder, ADAMW, {"bucket_cap_mb": 0.5}),
    "MoE, fp32": (moe, ADAMW, {"bucket_cap_mb": 0.5}),
    "MoE, bf16": (lambda: moe(dtype=torch.bfloat16), ADAMW, {"bucket_cap_mb": 0.5}),
    "GPT, torchao AdamW8bit": (lambda: _builders(GPT), ("torchao.AdamW8bit", {"lr": 1e-3}), {"bucket_cap_mb": 0.5}),
    "GPT, torchao AdamW4bit": (lambda: _builders(GPT), ("torchao.AdamW4bit", {"lr": 1e-3}), {"bucket_cap_mb": 0.5}),
    "GPT, bitsandbytes AdamW8bit": (lambda: _builders(GPT), ("bitsandbytes.AdamW8bit", {"lr": 1e-3}),
                                    {"bucket_cap_mb": 0.5}),
    "MLP, torchao AdamW8bit": (mlp, ("torchao.AdamW8bit", {"lr": 1e-3}), {"bucket_cap_mb": 0.5}),
}
QUICK = ("resnet-64, fp32, batch 2, AdamW", "TransformerEncoder, fp32", "MoE, fp32", "GPT, torchao AdamW8bit")


def row(label: str) -> dict[str, Any]:
    """Planned against measured for one row (``bench_plan.compare_job``)."""
    builders, (cls, kwargs), engine = ROWS[label]
    cls = low_bit(cls) if isinstance(cls, str) else cls
    return compare_job(*builders(), cls, kwargs, engine)


def kept_outside(labels: tuple[str, ...], side: str) -> dict[str, int | None]:
    """In this process, row after row: what the plan measured its kernels keep outside torch's allocator
    (``side="planned"``), or what two steps of each loop run for real left outside it once everything is freed
    (``"measured"``), after a step of a small other model (imports and one-time set-up, on both sides). A kernel
    shows it on its first run in a process: call in a fresh one (:func:`outside`)."""
    torch.set_num_threads(1)
    for loop in LOOPS:  # what a first step imports and sets up once (tens of MiB of modules), not a kernel's
        Job(nn.Linear(3, 5), loop, lambda m, x: m(x).sum(), torch.optim.AdamW, {"lr": 1e-3}, {}).step(
            [torch.randn(2, 3)])
    gc.collect()
    out: dict[str, int | None] = {}
    for label in labels:
        builders, (cls, kwargs), engine = ROWS[label]
        cls = low_bit(cls) if isinstance(cls, str) else cls
        model_fn, batch_fn, loss = builders()
        if side == "planned":
            out[label] = plan(model_fn, batch_fn, loss, cls, **engine, **kwargs).outside_bytes
            continue
        before = _outside.outside_bytes()
        for loop in LOOPS:
            torch.manual_seed(0)
            job = Job(model_fn(), loop, loss, cls, kwargs, engine)
            for _ in range(2):
                job.step([batch_fn()])
            del job
        gc.collect()
        out[label] = _outside.outside_bytes() - before
    return out


def outside(labels: tuple[str, ...]) -> dict[str, dict[str, int | None]]:
    """Planned against measured, each side in a fresh process of its own: ``{label: {"planned", "measured"}}``."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        sides = {side: pool.apply(kept_outside, (labels, side)) for side in ("planned", "measured")}
    return {label: {side: sides[side][label] for side in sides} for label in labels}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_plan_models", __doc__)
    args = h.parse(p, argv, quick={"threads": 1}, full={"threads": 2})
    run = h.Run("bench_plan_models", args)
    rows = {}
    print(f"{'model':<32} {'loop':<12} {'planned':>9} {'measured':>9} {'err':>7}  {'step planned':>12} "
          f"{'measured':>9}   saving planned / measured MiB")
    for label in (QUICK if args.quick else ROWS):
        print_rows(f"{label:<32}", rows.setdefault(label, row(label)))
    return run.finish({"rows": rows})


if __name__ == "__main__":
    main()

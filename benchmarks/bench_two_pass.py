"""clip_mode="two_pass" against the standard loop with exact clipping, and against the floor of one more backward.

    python -m benchmarks.bench_two_pass                  # the project's GPT at two sizes, with and without
                                                         # activation checkpointing: a few minutes on 2 cores
    python -m benchmarks.bench_two_pass --quick          # seconds

One process, AdamW(fused=True), the trainer's GPT (launch/gpt.py) on random byte sequences, batch 4, max_norm 0.05
(below the models' norms: the clipping acts). Variants on copies of one initial model (unit: one iteration):
fwd (the forward alone), fwd_bwd (forward and backward, no step), std (the standard loop), std_clip
(``clip_grad_norm_`` then the step), inb (in backward, no clipping), inb_exact (``clip_mode="exact"``: every
gradient held) and inb_two_pass. inb equals std and inb_exact and inb_two_pass equal std_clip bitwise, checked at
the end. From the medians of the same run: the phases F = fwd, B = fwd_bwd - fwd and S = std_clip - fwd_bwd, and
the floor of a second backward, (F + 2B + S) / (F + B + S), beside the paired ratio inb_two_pass / std_clip. Memory:
the allocator peak of each variant; the saving of two_pass (std_clip - inb_two_pass) as a fraction of the plain
in-backward saving (std - inb), and the forward's activations apart (net bytes a forward leaves alive), which a
second backward keeps alive through the first.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks import harness as h
from launch.gpt import GPT, loss_fn

MAX_NORM = 0.05
VOCAB = 256
# name -> (n_layer, n_head, n_embd, block_size), run at batch 4: shapes where gradients, not activations, set the
# peak (the README's --compare model is the first), so that a saving can show; quick: tiny
SIZES = {"gpt_512x4": (4, 8, 512, 32), "gpt_768x6": (6, 12, 768, 32)}
QUICK_SIZES = {"gpt_tiny": (2, 2, 64, 8)}


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (``use_reentrant=False``, as the engine needs)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def build(shape: tuple[int, int, int, int], ckpt: bool, device: torch.device) -> GPT:
    n_layer, n_head, n_embd, block = shape
    torch.manual_seed(0)
    model = GPT(VOCAB, block, n_layer, n_head, n_embd, tie_weights=False)
    if ckpt:
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model.to(device)


def variants(base: GPT, x: torch.Tensor, y: torch.Tensor, args: Any) -> dict[str, h.Variant]:
    out: dict[str, h.Variant] = {}

    def loss_of(model: nn.Module) -> torch.Tensor:
        return loss_fn(model(x), y)

    fwd_model, fb_model = copy.deepcopy(base), copy.deepcopy(base)
    out["fwd"] = h.Variant([lambda: loss_of(fwd_model).detach()], list(fwd_model.parameters()))

    def fwd_bwd() -> None:
        loss_of(fb_model).backward()
        for p in fb_model.parameters():
            p.grad = None

    out["fwd_bwd"] = h.Variant([fwd_bwd], list(fb_model.parameters()))
    for name, clip in (("std", False), ("std_clip", True)):
        model = copy.deepcopy(base)
        opt = h.adamw(model.parameters())

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt, clip: bool = clip) -> None:
            loss_of(model).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = h.Variant([step], list(model.parameters()), opt)
    for name, ref, mode in (("inb", "std", None), ("inb_exact", "std_clip", "exact"),
                            ("inb_two_pass", "std_clip", "two_pass")):
        model = copy.deepcopy(base)
        clip = {} if mode is None else {"max_grad_norm": MAX_NORM, "clip_mode": mode}
        opt = h.in_backward(model, args.bucket_cap_mb, fused=True, **clip)
        out[name] = h.Variant([lambda model=model, opt=opt: opt.backward(loss_of(model))], list(model.parameters()),
                              opt, ref)
    return out


def activation_bytes(base: GPT, x: torch.Tensor, device: torch.device) -> int:
    """What one forward leaves alive for its backward (the graph's saved tensors and the logits)."""
    model = copy.deepcopy(base)
    kept: list[torch.Tensor] = []
    return h.allocator_peak(lambda: kept.append(model(x)), device)["net_bytes"]


def bench(name: str, shape: tuple[int, int, int, int], ckpt: bool, args: Any, device: torch.device) -> dict[str, Any]:
    base = build(shape, ckpt, device)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (args.batch, shape[3] + 1), generator=g).to(device)
    x, y = data[:, :-1], data[:, 1:]
    vs = variants(base, x, y, args)
    pairs = [("inb", "std"), ("inb_exact", "std_clip"), ("inb_two_pass", "std_clip"), ("inb_two_pass", "inb_exact")]
    res = h.measure(vs, args, pairs, device)
    med = {n: v["timing"]["median_s"] for n, v in res["variants"].items()}
    f, b = med["fwd"], med["fwd_bwd"] - med["fwd"]
    s = med["std_clip"] - med["fwd_bwd"]
    floor = (f + 2 * b + s) / (f + b + s)
    peak = {n: v["memory"]["peak_bytes"] for n, v in res["variants"].items()}
    plain, two = peak["std"] - peak["inb"], peak["std_clip"] - peak["inb_two_pass"]
    measured = res["ratios"]["inb_two_pass/std_clip"]["paired_median"]
    res["two_pass"] = {
        "phases_s": {"forward": f, "backward": b, "step_and_clip": s}, "floor": floor,
        "ratio_vs_std_clip": measured, "ratio_over_floor": measured / floor,
        "saving_bytes": {"plain_in_backward": plain, "two_pass": two, "exact": peak["std_clip"] - peak["inb_exact"]},
        "saving_fraction_of_plain": two / plain if plain > 0 else None,
        "activation_bytes": activation_bytes(base, x, device), "grad_bytes": h.nbytes(base.parameters()),
    }
    t = res["two_pass"]
    print(f"\n=== {name}{' + activation checkpointing' if ckpt else ''}: {h.nbytes(base.parameters()) / 4:.0f} "
          f"params, {h.mib(t['grad_bytes'])} MiB of gradients, activations {h.mib(t['activation_bytes'])} MiB")
    h.print_table(res)
    print(f"    phases ms: F {f * 1e3:.2f}, B {b * 1e3:.2f}, S {s * 1e3:.2f}; floor (F+2B+S)/(F+B+S) {floor:.3f}; "
          f"two_pass / std_clip {measured:.3f} = {measured / floor:.3f} x floor")
    frac = t["saving_fraction_of_plain"]
    print(f"    peak saved, MiB: plain {h.mib(plain)}, two_pass {h.mib(two)}"
          f" ({'n/a' if frac is None else f'{frac:.3f}'} of plain), exact {h.mib(t['saving_bytes']['exact'])}")
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_two_pass", __doc__)
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the engine's bucket_cap_mb (default: its own)")
    p.add_argument("--sizes", default=None, help=f"comma-separated subset of {', '.join(SIZES)}")
    p.set_defaults(batch=4)
    args = h.parse(p, argv, quick={"threads": 1, "repeats": 2, "iters": 1, "warmup": 1, "bucket_cap_mb": 0.02},
                   full={"threads": min(2, os.cpu_count() or 1), "repeats": 11, "iters": 1, "warmup": 2})
    sizes = QUICK_SIZES if args.quick else SIZES
    chosen = list(sizes) if args.sizes is None else args.sizes.split(",")
    if not set(chosen) <= set(sizes):
        p.error(f"--sizes must be a subset of {', '.join(sizes)}")
    run = h.Run("bench_two_pass", args)
    device = h.device_of(args)
    models = {f"{n}{'/ckpt' if ckpt else ''}": bench(n, sizes[n], ckpt, args, device)
              for n in chosen for ckpt in (False, True)}
    return run.finish({"max_norm": MAX_NORM, "models": models})


if __name__ == "__main__":
    main()

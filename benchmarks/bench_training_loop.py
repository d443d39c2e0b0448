"""One process: clipping, gradient accumulation and GradScaler in backward, against their standard loops.

    python -m benchmarks.bench_training_loop [--models many_small,few_large]   # about a minute per model
    python -m benchmarks.bench_training_loop --quick                           # seconds

bench_core's models, AdamW(fused=True), batch 8. Three sections of variants on copies of the same initial model;
each in-backward variant must end bitwise equal (parameters and optimizer state) to its standard counterpart:
clipping at max_norm c (unit: one iteration): std, std_clip (``clip_grad_norm_``), std_clip_per_tensor,
std_clip_previous_norm (grads scaled by the previous step's norm) against inb, inb_track_norm, inb_clip_exact,
inb_clip_previous_norm, inb_clip_per_parameter; accumulation (unit: one optimizer step of k micro-batches, each
its own input, loss / k): std_accum against inb_accum; grad_scaler (unit: one iteration, ``GradScaler("cpu")``, no
autocast): std_scaler against inb_scaler_exact and inb_scaler_per_bucket. A unit's peak is measured per
micro-batch, each placed above what the micro-batches before it left allocated.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import harness as h

# section -> {variant: (its counterpart, in-backward options)}; standard loops have no counterpart
SECTIONS: dict[str, dict[str, tuple[str | None, dict[str, Any]]]] = {
    "clipping": {
        "std": (None, {}), "std_clip": (None, {}), "std_clip_per_tensor": (None, {}),
        "std_clip_previous_norm": (None, {}), "inb": ("std", {}), "inb_track_norm": ("std", {"track_grad_norm": True}),
        "inb_clip_exact": ("std_clip", {"clip_mode": "exact"}),
        "inb_clip_previous_norm": ("std_clip_previous_norm", {"clip_mode": "previous_norm"}),
        "inb_clip_per_parameter": ("std_clip_per_tensor", {"clip_mode": "per_parameter"}),
    },
    "accumulation": {"std_accum": (None, {}), "inb_accum": ("std_accum", {})},
    "grad_scaler": {"std_scaler": (None, {}), "inb_scaler_exact": ("std_scaler", {"overflow": "exact"}),
                    "inb_scaler_per_bucket": ("std_scaler", {"overflow": "per_bucket"})},
}
# in-backward variants that hold the step's gradients until backward ends: no saving in theory
HOLDING = {"inb_clip_exact", "inb_scaler_exact", "inb_accum"}
EXTRA_RATIOS = [("std_clip", "std"), ("inb_track_norm", "inb"), ("inb_clip_exact", "inb"),
                ("inb_clip_per_parameter", "inb"), ("inb_clip_previous_norm", "std_clip")]


def clip(kind: str, params: list[torch.Tensor], c: float, last: dict[str, Any]) -> None:
    """What the standard loop does between backward and step for clipping variant ``kind``."""
    if kind == "std_clip":
        last["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, c)
    elif kind == "std_clip_per_tensor":
        for p in params:
            torch.nn.utils.clip_grad_norm_([p], c)
    elif kind == "std_clip_previous_norm":
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads)
        if last.get("previous") is not None:
            coef = torch.clamp(c / (last["previous"] + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        last["previous"] = last["grad_norm"] = norm


def variant(section: str, name: str, model: nn.Module, xs: list[torch.Tensor], args: Any
            ) -> tuple[h.Variant, Callable[[], dict[str, Any]]]:
    """Variant ``name`` on ``model``, and what to report of its last step."""
    ref, kw = SECTIONS[section][name]
    params = list(model.parameters())
    k = len(xs) if section == "accumulation" else 1
    scaler = torch.amp.GradScaler(args.device) if section == "grad_scaler" else None
    last: dict[str, Any] = {}

    def backward(x: torch.Tensor) -> None:
        loss = model(x).square().mean() / k
        (scaler.scale(loss) if scaler else loss).backward()

    if ref is None:
        opt = h.adamw(params)

        def finish() -> None:
            clip(name, params, args.max_norm, last)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)

        def last_step() -> None:
            backward(xs[k - 1])
            finish()

        def info() -> dict[str, Any]:
            return {"grad_norm": float(last["grad_norm"]) if "grad_norm" in last else None,
                    "scale": scaler.get_scale() if scaler else None}

        return h.Variant([(lambda x=x: backward(x)) for x in xs[:k - 1]] + [last_step], params, opt), info
    if "clip_mode" in kw:
        kw["max_grad_norm"] = args.max_norm
    if scaler:
        kw["grad_scaler"] = scaler
    opt = h.in_backward(model, args.bucket_cap_mb, fused=True, accumulation_steps=k, **kw)

    def step(x: torch.Tensor) -> None:
        backward(x)
        if scaler:
            scaler.update()

    def info() -> dict[str, Any]:
        s = opt.last_step
        return {"grad_norm": None if s.grad_norm is None else float(s.grad_norm), "params_stepped": s.params_stepped,
                "clip_coef": None if s.clip_coef is None else float(s.clip_coef), "overflow": s.overflow,
                "micro_batches_pending": opt.micro_batches, "scale": scaler.get_scale() if scaler else None}

    return h.Variant([(lambda x=x: step(x)) for x in xs[:k]], params, opt, ref), info


def bench_section(section: str, base: nn.Module, xs: list[torch.Tensor], args: Any, device: torch.device
                  ) -> dict[str, Any]:
    built = {n: variant(section, n, copy.deepcopy(base), xs, args) for n in SECTIONS[section]}
    variants = {n: v for n, (v, _) in built.items()}
    pairs = [(n, v.reference) for n, v in variants.items() if v.reference]
    if section == "clipping":
        pairs += EXTRA_RATIOS
    res = h.measure(variants, args, pairs, device)
    grads = h.nbytes(base.parameters())
    for n, v in res["variants"].items():
        v["info"] = built[n][1]()
        if variants[n].reference:
            baseline = "std_clip" if n.startswith("inb_clip") else variants[n].reference
            largest = max(h.bucket_bytes(variants[n].opt))
            v["saving"] = {"vs": baseline, "theoretical_bytes": 0 if n in HOLDING else grads - largest,
                           "achieved_bytes": res["variants"][baseline]["memory"]["peak_bytes"]
                           - v["memory"]["peak_bytes"]}
    print(f"\n  -- {section}: {len(xs) if section == 'accumulation' else 1} backward(s) per unit")
    h.print_table(res)
    print("    peak saved, MiB (theory): " + ", ".join(
        f"{n} vs {v['saving']['vs']} {h.mib(v['saving']['achieved_bytes'])} "
        f"({h.mib(v['saving']['theoretical_bytes'])})" for n, v in res["variants"].items() if "saving" in v))
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_training_loop", __doc__)
    p.add_argument("--max-norm", type=float, default=None,
                   help="clipping threshold (default 1.0; quick: 0.05, below the tiny model's norm: clipping acts)")
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="the engine's bucket_cap_mb (default: its own; quick: 0.05, several buckets)")
    p.add_argument("--models", default="many_small", help="comma-separated: many_small, few_large")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    args = h.parse(p, argv, quick={"threads": 1, "repeats": 2, "iters": 1, "warmup": 2, "max_norm": 0.05,
                                   "bucket_cap_mb": 0.05},
                   full={"threads": min(2, os.cpu_count() or 1), "repeats": 25, "iters": 3, "warmup": 3,
                         "max_norm": 1.0})
    if args.accumulation < 2 or not set(args.sections.split(",")) <= set(SECTIONS):
        p.error(f"--accumulation must be >= 2 and --sections a subset of {', '.join(SECTIONS)}")
    run = h.Run("bench_training_loop", args)
    device = h.device_of(args)
    models = {}
    for name in args.models.split(","):
        build, width = h.models(args.quick)[name]
        torch.manual_seed(0)
        base = build().to(device)
        xs = [torch.randn(args.batch, width, device=device) for _ in range(args.accumulation)]
        print(f"\n=== {name}: {len(list(base.parameters()))} tensors, {h.mib(h.nbytes(base.parameters()))} MiB of "
              f"gradients, batch {args.batch}, max_norm {args.max_norm:g}, k={args.accumulation}")
        models[name] = {"n_tensors": len(list(base.parameters())), "grad_bytes": h.nbytes(base.parameters()),
                        "sections": {s: bench_section(s, base, xs, args, device) for s in args.sections.split(",")}}
    return run.finish({"models": models})


if __name__ == "__main__":
    main()

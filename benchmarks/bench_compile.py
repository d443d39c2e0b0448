"""torch.compile and in-backward steps: the memory saving with the model eager, compiled per block, compiled whole.

    python -m benchmarks.bench_compile [--quick]   # full: inductor (a C++ compiler on CPU); quick: aot_eager, seconds

A compiled region's backward hands all its gradients over at once: per block the saving stays, whole-model it is
gone (the optimizer warns once; ``last_step.grad_bytes_peak`` shows it). Each in-backward mode must end equal to the
fused standard loop compiled the same way.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from torch import nn

from benchmarks import harness as h

MODES = ("eager", "per_block", "whole")


def compiled(model: nn.Sequential, mode: str, backend: str) -> nn.Module:
    if mode == "per_block":
        for block in model:
            block.compile(backend=backend)
    return torch.compile(model, backend=backend) if mode == "whole" else model


def variant(kind: str, mode: str, base: nn.Sequential, x: torch.Tensor, args: Any) -> h.Variant:
    model = copy.deepcopy(base)
    params = list(model.parameters())
    run = compiled(model, mode, args.backend)

    def backward() -> None:
        run(x).square().mean().backward()

    if kind == "standard":
        return h.standard(backward, params, h.adamw(params))
    opt = h.in_backward(model, args.bucket_cap_mb, fused=True)
    return h.Variant([backward], params, opt, f"standard_{mode}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_compile", __doc__)
    p.add_argument("--backend", default=None, help="torch.compile backend (full: inductor; quick: aot_eager)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the engine's bucket_cap_mb (quick: 0.05)")
    args = h.parse(p, argv, quick={"threads": 1, "repeats": 3, "iters": 1, "warmup": 2, "bucket_cap_mb": 0.05,
                                   "backend": "aot_eager"},
                   full={"threads": min(2, os.cpu_count() or 1), "repeats": 15, "iters": 3, "warmup": 3,
                         "backend": "inductor"})
    run = h.Run("bench_compile", args)
    device = h.device_of(args)
    build, width = h.models(args.quick)["many_small"]
    torch.manual_seed(0)
    base = build().to(device)
    x = torch.randn(args.batch, width, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        variants = {f"{kind}_{mode}": variant(kind, mode, base, x, args)
                    for mode in MODES for kind in ("standard", "inbackward")}
        res = h.measure(variants, args, [(f"inbackward_{m}", f"standard_{m}") for m in MODES], device)
    grads = h.nbytes(base.parameters())
    res["grad_bytes"] = grads
    # the optimizer's warning that the saving is lost: expected once, from the whole-model one
    res["lost_saving_warnings"] = sum("saves no gradient memory" in str(w.message) for w in caught)
    res["saving"] = {}
    for m in MODES:
        opt = variants[f"inbackward_{m}"].opt
        largest = max(h.bucket_bytes(opt))
        std = res["variants"][f"standard_{m}"]["memory"]["peak_bytes"]
        ib = res["variants"][f"inbackward_{m}"]["memory"]["peak_bytes"]
        res["saving"][m] = {"achieved_bytes": std - ib, "theoretical_bytes": grads - largest,
                            "fraction": (std - ib) / (grads - largest) if grads > largest else None,
                            "grad_bytes_peak": opt.last_step.grad_bytes_peak}
    print(f"\n=== many_small, backend {args.backend}: {h.mib(grads)} MiB of gradients, batch {args.batch}")
    h.print_table(res)
    for m, s in res["saving"].items():
        frac = "n/a" if s["fraction"] is None else f"{s['fraction']:.3f}"
        print(f"    {m:<10} saving {h.mib(s['achieved_bytes'])} / {h.mib(s['theoretical_bytes'])} MiB theoretical "
              f"= {frac}; gradient bytes held at peak {h.mib(s['grad_bytes_peak'])} MiB")
    return run.finish(res)


if __name__ == "__main__":
    main()

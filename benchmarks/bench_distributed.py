"""Two ranks: in-backward AdamW against the standard loop under DDP and FSDP2 (gloo on CPU; NCCL with CUDA).

    python -m benchmarks.bench_distributed            # about 75 s on 2 cores; spawns its ranks itself
    python -m benchmarks.bench_distributed --quick    # seconds

Every rank builds the same many_small (default 16 x 512: 66 tensors, 17.1 MiB of gradients), one thread per rank,
and feeds it its own input. Variants, AdamW(fused=True): ddp_view{0,1}_std/_inb (DDP with gradient_as_bucket_view
off/on; the standard loop / ``InBackwardOptimizer(ddp_model, AdamW)``), fsdp2_std/_inb/_perparam (``fully_shard``
per block and root; the in-backward optimizer with its buckets / with ``per_parameter=True``) and fsdp2_hooks
(torchtitan's way: one AdamW per parameter, stepped in its post-accumulate-grad hook). Each in-backward variant
must end bitwise equal to the standard loop under the same wrapper, on every rank; fsdp2_inb against
fsdp2_perparam is the buckets' goal: no higher peak, no slower. DDP's bucket cap is scaled to the model (1 MiB: its
25 MiB default would hold almost all 17 MiB at once); the engine's cap under FSDP2 is its default. Memory per rank: gloo's work threads allocate and free tensors that torch.profiler
does not see, so the peak quoted is heap_shim.c's tensor bytes of every thread (median of --memory-iters), the
profiler's beside it; the saving is a fraction of the gradient bytes the standard loop holds on the rank (DDP
without bucket views: a full .grad copy; with them: none, n/a; FSDP2: the sharded gradient).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from benchmarks import harness as h

BUCKETS_VS_PER_PARAM = ("fsdp2_inb", "fsdp2_perparam")
VARIANTS = ("ddp_view0_std", "ddp_view0_inb", "ddp_view1_std", "ddp_view1_inb", "fsdp2_std", "fsdp2_inb",
            "fsdp2_perparam", "fsdp2_hooks")


def variant(name: str, base: nn.Module, x: torch.Tensor, mesh: Any, args: Any) -> h.Variant:
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapper, loop = name.rsplit("_", 1)
    module = copy.deepcopy(base)
    if wrapper == "fsdp2":
        model = h.fully_shard_blocks(module, mesh)
    else:
        ids = [x.device.index] if x.device.type == "cuda" else None
        model = DDP(module, device_ids=ids, gradient_as_bucket_view=wrapper == "ddp_view1",
                    bucket_cap_mb=args.ddp_bucket_cap_mb)
    params = list(model.parameters())

    def backward() -> None:
        model(x).square().mean().backward()

    if loop == "std":
        return h.standard(backward, params, h.adamw(params))
    if loop in ("inb", "perparam"):
        cap = args.bucket_cap_mb if wrapper == "fsdp2" else None  # under DDP the buckets are DDP's
        opt = h.in_backward(model, cap, fused=True, per_parameter=loop == "perparam")
        return h.Variant([backward], params, opt, f"{wrapper}_std")
    optims = {p: h.adamw([p]) for p in params}

    def hook(p: torch.Tensor) -> None:
        optims[p].step()
        optims[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return h.Variant([backward], params, None, "fsdp2_std")


def run_rank(rank: int, args: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    device = h.device_of(args, rank)
    mesh = init_device_mesh(device.type, (args.world,))
    torch.manual_seed(0)
    base = h.many_small(args.width, args.depth).to(device)  # the same on every rank
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    variants = {n: variant(n, base, x, mesh, args) for n in VARIANTS}
    pairs = [(n, v.reference) for n, v in variants.items() if v.reference] + [BUCKETS_VS_PER_PARAM]
    res = h.measure(variants, args, pairs, device, args.memory_iters)
    res["held_grad_bytes"] = {"ddp_view0": h.nbytes(variants["ddp_view0_std"].params), "ddp_view1": 0,
                              "fsdp2": h.nbytes(variants["fsdp2_std"].params)}
    res["bucket_bytes"] = {n: h.bucket_bytes(variants[n].opt) for n in ("ddp_view0_inb", "fsdp2_inb")}
    return res


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per in-backward variant: the paired time ratio and the peak saving on every rank, and its agreement."""
    out = {}
    for n, ref in ((n, v["reference"]) for n, v in ranks[0]["variants"].items() if v["reference"]):
        held = [r["held_grad_bytes"][n.rsplit("_", 1)[0]] for r in ranks]
        saved = [r["variants"][ref]["memory"]["peak_bytes"] - r["variants"][n]["memory"]["peak_bytes"] for r in ranks]
        out[f"{n}/{ref}"] = {
            "time_ratio_paired": [r["ratios"][f"{n}/{ref}"]["paired_median"] for r in ranks],
            "peak_bytes": [(r["variants"][ref]["memory"]["peak_bytes"], r["variants"][n]["memory"]["peak_bytes"])
                           for r in ranks],
            "saved_bytes": saved, "held_grad_bytes": held,
            "saving_fraction_of_held": [s / g if g else None for s, g in zip(saved, held)],
            "params_bitwise_equal": all(r["variants"][n]["agreement"]["params_bitwise_equal"] for r in ranks),
            "max_abs_diff": max(r["variants"][n]["agreement"]["max_abs_diff"] for r in ranks),
        }
    return out


def buckets_vs_per_parameter(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """FSDP2 in backward with buckets against ``per_parameter=True``, per rank: paired time ratio, peaks (per
    parameter, buckets) and their ratio; the buckets' goal is a peak ratio <= 1 at a time ratio <= 1."""
    a, b = BUCKETS_VS_PER_PARAM
    peaks = [(r["variants"][b]["memory"]["peak_bytes"], r["variants"][a]["memory"]["peak_bytes"]) for r in ranks]
    return {"time_ratio_paired": [r["ratios"][f"{a}/{b}"]["paired_median"] for r in ranks], "peak_bytes": peaks,
            "peak_ratio": [y / x for x, y in peaks], "buckets": [len(r["bucket_bytes"][a]) for r in ranks]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_distributed", __doc__)
    p.add_argument("--width", type=int, default=None, help="many_small width (default 512; quick 128)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks (default 16; quick 8)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="the engine's cap under FSDP2 (default: its own, DEFAULT_BUCKET_CAP_MB)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default 1)")
    h.add_rank_memory_options(p)
    common = {"threads": 1, "world": 2}
    args = h.parse(p, argv, quick={**common, "repeats": 2, "iters": 1, "warmup": 2, "width": 128, "depth": 8,
                                   "ddp_bucket_cap_mb": 0.1},
                   full={**common, "repeats": 25, "iters": 3, "warmup": 3, "width": 512, "depth": 16,
                         "ddp_bucket_cap_mb": 1.0})
    run = h.Run("bench_distributed", args)
    ranks, no_shim = h.spawn_ranks(run_rank, args)
    summary = summarize(ranks)
    for r in ranks:
        print(f"\n=== rank {r['rank']}: peak = {'the profiler' if no_shim else 'tensor bytes of every thread'}")
        h.print_table(r)
    print(f"\n=== per rank: in backward / standard under the same wrapper{'':<8}time (paired)   peak MiB   saved/held")
    for key, s in summary.items():
        for k in range(len(ranks)):
            frac = s["saving_fraction_of_held"][k]
            print(f"    {key if k == 0 else '':<44}{k:>5}{s['time_ratio_paired'][k]:16.3f}"
                  f"{h.mib(s['peak_bytes'][k][0]):>8} ->{h.mib(s['peak_bytes'][k][1]):>6}"
                  f"{'n/a' if frac is None else f'{frac:.3f}':>10}   bitwise {s['params_bitwise_equal']}")
    vs = buckets_vs_per_parameter(ranks)
    print(f"\n=== FSDP2: buckets / per_parameter=True{'':<12}rank   time (paired)   peak MiB   peak ratio   buckets")
    for k, (t, (pp, b), r, n) in enumerate(zip(*vs.values())):
        print(f"    {'/'.join(BUCKETS_VS_PER_PARAM) if k == 0 else '':<44}{k:>5}{t:16.3f}{h.mib(pp):>8} ->"
              f"{h.mib(b):>6}{r:>10.3f}{n:>10}")
    return run.finish({"all_thread_memory": no_shim is None, "per_rank": ranks, "summary": summary,
                       "fsdp2_buckets_vs_per_parameter": vs})


if __name__ == "__main__":
    main()

"""In-backward AdamW against the standard loop under DDP and FSDP2 (2 ranks), tensor parallel (2) and FSDP2 x TP (4),
gloo on CPU (NCCL with CUDA).

    python -m benchmarks.bench_distributed                     # spawns its ranks itself: 2, 2, then 4
    python -m benchmarks.bench_distributed --quick             # seconds to minutes (4 ranks on 2 cores)
    python -m benchmarks.bench_distributed --layouts tp,fsdp2+tp   # some layouts (dp: DDP and FSDP2; tp; fsdp2+tp)

The dp layout takes about 75 s on 2 idle cores; tp and fsdp2+tp took 13 minutes together on 2 cores 74 % busy with
other work. Quick: 38 s for dp on a lightly loaded machine; all three layouts 3.5 minutes on 2 cores 82 % busy.

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
without bucket views: a full .grad copy; with them: none, n/a; FSDP2: the sharded gradient) and of the
theoretical saving (those bytes minus the largest bucket, where the buckets are known).

Tensor parallel (``--layouts``; every layout by default): ``tp`` on 2 ranks and ``fsdp2+tp`` on 4, a (dp=2, tp=2)
mesh, each its own spawned job. The model is tests/test_tp.py's: ``--tp-depth`` residual blocks of (LayerNorm,
Linear w -> 2w, GELU, Linear 2w -> w), w = ``--tp-width``, and a final LayerNorm (default 16 x 512: 98 tensors,
64.1 MiB of gradients; quick 8 x 256), laid out as torchtitan does: ColwiseParallel up, RowwiseParallel down,
SequenceParallel norms (``Replicate`` parameters, ``Partial`` gradients); under fsdp2+tp TP first, then
``fully_shard`` per block and the root on "dp". The TP ranks of a replica see the same ``--batch`` sequences of
``SEQUENCE`` tokens, each its shard of every sequence: few tokens, so that the gradients outweigh the activations (with
many, both loops peak at the start of backward, on the activations, and nothing is saved). Variants tp_std/tp_inb and
fsdp2+tp_std/fsdp2+tp_inb, AdamW(fused=True) on the DTensors, the in-backward cap ``--tp-bucket-cap-mb``.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import nn

from benchmarks import harness as h

BUCKETS_VS_PER_PARAM = ("fsdp2_inb", "fsdp2_perparam")
VARIANTS = ("ddp_view0_std", "ddp_view0_inb", "ddp_view1_std", "ddp_view1_inb", "fsdp2_std", "fsdp2_inb",
            "fsdp2_perparam", "fsdp2_hooks")
LAYOUTS = {"dp": 2, "tp": 2, "fsdp2+tp": 4}  # layout -> ranks; dp: DDP and FSDP2 (VARIANTS)
TP_SIZE = 2  # tensor-parallel ranks in either TP layout (fsdp2+tp: a (dp=2, tp=2) mesh)
SEQUENCE = 4  # tokens per sequence in the TP layouts: split over the TP ranks by SequenceParallel


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


class MLPBlock(nn.Module):
    """x + down(gelu(up(norm(x)))): tests/test_tp.py's block (GELU for its ReLU)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TPNet(nn.Module):
    """``depth`` :class:`MLPBlock` and a final LayerNorm."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # a DTensor, this rank's sequence shard: unwrapped outside FSDP2's root (a view)


def tp_parallelize(module: TPNet, tp_mesh: Any, dp_mesh: Any) -> nn.Module:
    """torchtitan's layout: SequenceParallel norms, ColwiseParallel up (gathering the sequence), RowwiseParallel down
    (scattering it back); then, with ``dp_mesh``, ``fully_shard`` per block and the root on it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(module, tp_mesh, {"norm": SequenceParallel()})
    for block in module.blocks:
        parallelize_module(block, tp_mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                            "down": RowwiseParallel(output_layouts=Shard(1))})
    if dp_mesh is None:
        return module
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(module, mesh=dp_mesh)


def tp_variant(name: str, base: TPNet, x: torch.Tensor, tp_mesh: Any, dp_mesh: Any, args: Any) -> h.Variant:
    wrapper, loop = name.rsplit("_", 1)
    model = tp_parallelize(copy.deepcopy(base), tp_mesh, dp_mesh)
    params = list(model.parameters())

    def backward() -> None:
        h.local(model(x)).square().mean().backward()

    if loop == "std":
        return h.standard(backward, params, h.adamw(params))
    return h.Variant([backward], params, h.in_backward(model, args.tp_bucket_cap_mb, fused=True), f"{wrapper}_std")


def run_tp_rank(rank: int, args: Any) -> dict[str, Any]:
    """One rank of the ``args.layout`` job ("tp" or "fsdp2+tp"): its standard loop and its in-backward variant."""
    from torch.distributed.device_mesh import init_device_mesh

    device = h.device_of(args, rank)
    if args.layout == "tp":
        tp_mesh, dp_mesh = init_device_mesh(device.type, (args.world,), mesh_dim_names=("tp",)), None
    else:
        mesh = init_device_mesh(device.type, (args.world // TP_SIZE, TP_SIZE), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    torch.manual_seed(0)
    base = TPNet(args.tp_width, args.tp_depth).to(device)  # the same on every rank
    dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()  # the TP ranks of a replica share its batch
    x = torch.randn(args.batch, SEQUENCE, args.tp_width, generator=torch.Generator().manual_seed(100 + dp_rank))
    x = x.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()].contiguous().to(device)  # its sequence shard
    std, inb = f"{args.layout}_std", f"{args.layout}_inb"
    variants = {n: tp_variant(n, base, x, tp_mesh, dp_mesh, args) for n in (std, inb)}
    res = h.measure(variants, args, [(inb, std)], device, args.memory_iters)
    res["held_grad_bytes"] = {args.layout: h.nbytes(variants[std].params)}
    res["bucket_bytes"] = {inb: h.bucket_bytes(variants[inb].opt)}
    res["mesh"] = {"dp": 1 if dp_mesh is None else dp_mesh.size(), "tp": tp_mesh.size()}
    return res


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per in-backward variant: the paired time ratio and the peak saving on every rank, as a fraction of the
    gradient bytes the standard loop holds and (where its buckets are known) of the theoretical saving, those bytes
    minus the largest bucket; and its agreement."""
    out = {}
    for n, ref in ((n, v["reference"]) for n, v in ranks[0]["variants"].items() if v["reference"]):
        held = [r["held_grad_bytes"][n.rsplit("_", 1)[0]] for r in ranks]
        saved = [r["variants"][ref]["memory"]["peak_bytes"] - r["variants"][n]["memory"]["peak_bytes"] for r in ranks]
        largest = [max(r["bucket_bytes"][n]) if r["bucket_bytes"].get(n) else None for r in ranks]
        theoretical = [g - b if g and b is not None else None for g, b in zip(held, largest)]
        out[f"{n}/{ref}"] = {
            "time_ratio_paired": [r["ratios"][f"{n}/{ref}"]["paired_median"] for r in ranks],
            "peak_bytes": [(r["variants"][ref]["memory"]["peak_bytes"], r["variants"][n]["memory"]["peak_bytes"])
                           for r in ranks],
            "saved_bytes": saved, "held_grad_bytes": held,
            "saving_fraction_of_held": [s / g if g else None for s, g in zip(saved, held)],
            "largest_bucket_bytes": largest, "theoretical_saving_bytes": theoretical,
            "saving_fraction_of_theoretical": [s / t if t else None for s, t in zip(saved, theoretical)],
            "params_bitwise_equal": all(r["variants"][n]["agreement"]["params_bitwise_equal"] for r in ranks),
            "state_bitwise_equal": all(r["variants"][n]["agreement"].get("state_bitwise_equal", True) for r in ranks),
            "max_abs_diff": max(r["variants"][n]["agreement"]["max_abs_diff"] for r in ranks),
        }
    return out


def print_summary(summary: dict[str, Any], title: str) -> None:
    print(f"\n=== {title:<62}rank   time (paired)   peak MiB   saved/held   saved/theoretical")
    for key, s in summary.items():
        for k, frac in enumerate(s["saving_fraction_of_held"]):
            theor = s["saving_fraction_of_theoretical"][k]
            print(f"    {key if k == 0 else '':<44}{k:>5}{s['time_ratio_paired'][k]:16.3f}"
                  f"{h.mib(s['peak_bytes'][k][0]):>8} ->{h.mib(s['peak_bytes'][k][1]):>6}"
                  f"{'n/a' if frac is None else f'{frac:.3f}':>10}{'n/a' if theor is None else f'{theor:.3f}':>17}"
                  f"   bitwise {s['params_bitwise_equal']}")


def buckets_vs_per_parameter(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """FSDP2 in backward with buckets against ``per_parameter=True``, per rank: paired time ratio, peaks (per
    parameter, buckets) and their ratio; the buckets' goal is a peak ratio <= 1 at a time ratio <= 1."""
    a, b = BUCKETS_VS_PER_PARAM
    peaks = [(r["variants"][b]["memory"]["peak_bytes"], r["variants"][a]["memory"]["peak_bytes"]) for r in ranks]
    return {"time_ratio_paired": [r["ratios"][f"{a}/{b}"]["paired_median"] for r in ranks], "peak_bytes": peaks,
            "peak_ratio": [y / x for x, y in peaks], "buckets": [len(r["bucket_bytes"][a]) for r in ranks]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_distributed", __doc__)
    p.add_argument("--layouts", default="dp,tp,fsdp2+tp",
                   help="comma-separated, of: dp (DDP and FSDP2, 2 ranks), tp (2 ranks), fsdp2+tp (4 ranks, "
                        "dp=2 x tp=2); default all")
    p.add_argument("--width", type=int, default=None, help="many_small width, dp layout (default 512; quick 128)")
    p.add_argument("--depth", type=int, default=None, help="many_small blocks, dp layout (default 16; quick 8)")
    p.add_argument("--tp-width", type=int, default=None, help="TP model width (default 512; quick 256)")
    p.add_argument("--tp-depth", type=int, default=None, help="TP model blocks (default 16; quick 8)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="the engine's cap under FSDP2 (default: its own, DEFAULT_BUCKET_CAP_MB)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default 1)")
    p.add_argument("--tp-bucket-cap-mb", type=float, default=None,
                   help="the engine's cap in the TP layouts (default: its own; quick 1, so that the quick model has "
                        "several buckets under TP alone)")
    h.add_rank_memory_options(p)
    common = {"threads": 1, "world": 2}
    args = h.parse(p, argv, quick={**common, "repeats": 2, "iters": 1, "warmup": 2, "width": 128, "depth": 8,
                                   "ddp_bucket_cap_mb": 0.1, "tp_width": 256, "tp_depth": 8, "tp_bucket_cap_mb": 1.0},
                   full={**common, "repeats": 25, "iters": 3, "warmup": 3, "width": 512, "depth": 16,
                         "ddp_bucket_cap_mb": 1.0, "tp_width": 512, "tp_depth": 16, "tp_bucket_cap_mb": None})
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or set(layouts) - set(LAYOUTS):
        p.error(f"--layouts {args.layouts!r}: choose among {', '.join(LAYOUTS)}")
    run = h.Run("bench_distributed", args)
    figures: dict[str, Any] = {"layouts": layouts}
    no_shims = []
    for layout in layouts:
        world = LAYOUTS[layout]
        print(f"\n##### {layout}: {world} ranks", flush=True)
        ranks, no_shim = h.spawn_ranks(run_rank if layout == "dp" else run_tp_rank,
                                       argparse.Namespace(**{**vars(args), "world": world, "layout": layout}))
        no_shims.append(no_shim)
        summary = summarize(ranks)
        for r in ranks:
            print(f"\n=== {layout}, rank {r['rank']}: peak = "
                  f"{'the profiler' if no_shim else 'tensor bytes of every thread'}")
            h.print_table(r)
        print_summary(summary, f"{layout}, per rank: in backward / standard under the same wrapper")
        if layout != "dp":
            figures.setdefault("tensor_parallel", {})[layout] = {
                "world": world, "mesh": ranks[0]["mesh"], "per_rank": ranks, "summary": summary}
            continue
        vs = buckets_vs_per_parameter(ranks)
        print(f"\n=== FSDP2: buckets / per_parameter=True{'':<12}rank   time (paired)   peak MiB   peak ratio   "
              "buckets")
        for k, (t, (pp, b), r, n) in enumerate(zip(*vs.values())):
            print(f"    {'/'.join(BUCKETS_VS_PER_PARAM) if k == 0 else '':<44}{k:>5}{t:16.3f}{h.mib(pp):>8} ->"
                  f"{h.mib(b):>6}{r:>10.3f}{n:>10}")
        figures.update(per_rank=ranks, summary=summary, fsdp2_buckets_vs_per_parameter=vs)
    return run.finish({"all_thread_memory": all(x is None for x in no_shims), **figures})


if __name__ == "__main__":
    main()

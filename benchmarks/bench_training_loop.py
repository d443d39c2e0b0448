"""Training-loop benchmark: clipping, gradient accumulation and GradScaler, in backward against the standard loop.

Run (full, about a minute on 2 cores with the default many_small; 1.5 minutes with both models):
    python benchmarks/bench_training_loop.py [--models many_small,few_large]
Smoke run (a few seconds, tiny models):
    python benchmarks/bench_training_loop.py --quick --out /tmp/bench_training_loop.json

Single process, CPU, AdamW(fused=True), on bench_core's models (batch 8, loss = model(x).square().mean()). Three
sections, each a set of variants on deep copies of the same initial model; every variant runs the same iterations
on the same data, so at the end each in-backward variant must equal its standard-loop counterpart bitwise
(parameters and optimizer state, checked):

1. clipping (unit: one iteration), max_norm c = 1.0 (--max-norm; the last step's norm and clip factor are reported, to
   show whether the clipping was active):
     std                     loss.backward(); opt.step(); opt.zero_grad()
     std_clip                loss.backward(); clip_grad_norm_(params, c); opt.step(); opt.zero_grad()
     std_clip_per_tensor     ... for p in params: clip_grad_norm_([p], c) ...   (counterpart of per_parameter)
     std_clip_previous_norm  ... grads *= min(1, c / (previous step's norm + 1e-6)) ...  (of previous_norm)
     inb                     InBackwardOptimizer(model, AdamW): loss.backward()
     inb_track_norm          the same with track_grad_norm=True (no clipping)
     inb_clip_exact          max_grad_norm=c, clip_mode="exact": the step's gradients are held until backward ends
     inb_clip_previous_norm  clip_mode="previous_norm"
     inb_clip_per_parameter  clip_mode="per_parameter"
2. accumulation (unit: one optimizer step of k=4 micro-batches, --accumulation), each micro-batch its own input,
   loss / k:
     std_accum               k x loss.backward(), then opt.step(); opt.zero_grad()
     inb_accum               InBackwardOptimizer(..., accumulation_steps=k): k x loss.backward()
3. grad_scaler (unit: one iteration), torch.amp.GradScaler("cpu") with its defaults (no autocast: fp32 model, the
   scaler's loop and its unscale/inf-check work are what is measured):
     std_scaler              scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
     inb_scaler_exact        InBackwardOptimizer(..., grad_scaler=scaler, overflow="exact"):
                             scaler.scale(loss).backward(); scaler.update()
     inb_scaler_per_bucket   the same with overflow="per_bucket"

Timing and memory are bench_core's (its functions are imported, not copied): after warm-up, interleaved and rotated
repetitions of every variant of a section, medians and quartiles per unit, ratios both of the medians and as the
median of per-repetition ratios (the paired one, which cancels drift); the paired median difference is given in
ms too. The allocator peak of one unit of each variant is exact, from torch.profiler's memory events (running sum
of the signed deltas, above the unit's starting point: optimizer state exists, gradients are None). For
accumulation, each micro-batch is profiled on its own and its peak is placed above the step's start by adding the
net bytes of the micro-batches before it (the gradients they left in .grad).

Output: a table per section on stdout and a JSON file (default benchmarks/results/bench_training_loop.json, --out).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import dist_optim  # noqa: E402
from bench_core import (  # noqa: E402
    LR,
    WEIGHT_DECAY,
    _mib,
    bucket_bytes,
    model_specs,
    Run,
    profiled_peak,
    ratio,
    time_interleaved,
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_training_loop.json")

Fn = Callable[[], None]


@dataclass(frozen=True)
class Variant:
    name: str
    loop: str  # what the user writes, for the report
    reference: str | None = None  # standard-loop variant it must equal bitwise (None: it is a standard loop)
    baseline: str | None = None  # standard-loop variant its peak is compared with (the loop users have today)
    holds_grads: bool = False  # in-backward variant that holds the step's gradients (no saving in theory)

    @property
    def in_backward(self) -> bool:
        return self.name.startswith("inb")


@dataclass
class Built:
    micro_batches: list[Fn]  # one unit (iteration or optimizer step) = these, in order
    opt: Any
    info: Callable[[], dict[str, Any]]  # state worth reporting after the run (last grad norm, scale, ...)


# -- sections -------------------------------------------------------------------------------------------------------
def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _inb(model: nn.Module, args: argparse.Namespace, **kw: Any) -> dist_optim.InBackwardOptimizer:
    if args.bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = args.bucket_cap_mb
    return dist_optim.InBackwardOptimizer(
        model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True, **kw
    )


def _num(t: torch.Tensor | None) -> float | None:
    return None if t is None else float(t)


def _policy_info(opt: dist_optim.InBackwardOptimizer) -> Callable[[], dict[str, Any]]:
    def info() -> dict[str, Any]:
        s = opt.last_step
        return {"grad_norm": _num(s.grad_norm), "clip_coef": _num(s.clip_coef), "params_stepped": s.params_stepped,
                "params_skipped": s.params_skipped, "overflow": s.overflow}

    return info


CLIPPING = (
    Variant("std", "loss.backward(); opt.step(); opt.zero_grad()"),
    Variant("std_clip", "loss.backward(); clip_grad_norm_(params, c); opt.step(); opt.zero_grad()"),
    Variant("std_clip_per_tensor", "loss.backward(); for p in params: clip_grad_norm_([p], c); opt.step(); ..."),
    Variant("std_clip_previous_norm", "loss.backward(); grads *= min(1, c/(previous norm+1e-6)); opt.step(); ..."),
    Variant("inb", "loss.backward()", reference="std", baseline="std"),
    Variant("inb_track_norm", "track_grad_norm=True; loss.backward()", reference="std", baseline="std"),
    Variant("inb_clip_exact", "max_grad_norm=c; loss.backward()", reference="std_clip", baseline="std_clip",
            holds_grads=True),
    Variant("inb_clip_previous_norm", "max_grad_norm=c, clip_mode='previous_norm'; loss.backward()",
            reference="std_clip_previous_norm", baseline="std_clip"),
    Variant("inb_clip_per_parameter", "max_grad_norm=c, clip_mode='per_parameter'; loss.backward()",
            reference="std_clip_per_tensor", baseline="std_clip"),
)
CLIPPING_RATIOS = (
    ("std_clip", "std"),
    ("inb", "std"),
    ("inb_track_norm", "inb"),
    ("inb_track_norm", "std"),
    ("inb_clip_exact", "std_clip"),
    ("inb_clip_previous_norm", "std_clip"),
    ("inb_clip_per_parameter", "std_clip"),
    ("inb_clip_exact", "inb"),
    ("inb_clip_previous_norm", "inb"),
    ("inb_clip_per_parameter", "inb"),
    ("inb_clip_previous_norm", "std_clip_previous_norm"),
    ("inb_clip_per_parameter", "std_clip_per_tensor"),
)


def build_clipping(name: str, model: nn.Module, data: dict[str, Any], args: argparse.Namespace) -> Built:
    x, c = data["x"], args.max_norm
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        return model(x).square().mean()

    if name.startswith("std"):
        opt = _adamw(model)
        last: dict[str, Any] = {"grad_norm": None, "previous": None}

        if name == "std":
            def it() -> None:
                loss().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif name == "std_clip":
            def it() -> None:
                loss().backward()
                last["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, c)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif name == "std_clip_per_tensor":
            def it() -> None:
                loss().backward()
                for p in params:
                    torch.nn.utils.clip_grad_norm_([p], c)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif name == "std_clip_previous_norm":
            def it() -> None:
                loss().backward()
                grads = [p.grad for p in params]
                norm = torch.nn.utils.get_total_norm(grads)
                if last["previous"] is not None:
                    coef = torch.clamp(c / (last["previous"] + 1e-6), max=1.0)
                    for g in grads:
                        g.mul_(coef)
                last["previous"] = last["grad_norm"] = norm
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            raise ValueError(name)
        return Built([it], opt, lambda: {"grad_norm": _num(last["grad_norm"])})

    kw: dict[str, Any] = {
        "inb": {},
        "inb_track_norm": {"track_grad_norm": True},
        "inb_clip_exact": {"max_grad_norm": c, "clip_mode": "exact"},
        "inb_clip_previous_norm": {"max_grad_norm": c, "clip_mode": "previous_norm"},
        "inb_clip_per_parameter": {"max_grad_norm": c, "clip_mode": "per_parameter"},
    }[name]
    opt = _inb(model, args, **kw)

    def it() -> None:
        loss().backward()

    return Built([it], opt, _policy_info(opt))


ACCUMULATION = (
    Variant("std_accum", "k x (loss/k).backward(); opt.step(); opt.zero_grad()"),
    Variant("inb_accum", "accumulation_steps=k; k x (loss/k).backward()", reference="std_accum",
            baseline="std_accum"),
)
ACCUMULATION_RATIOS = (("inb_accum", "std_accum"),)


def build_accumulation(name: str, model: nn.Module, data: dict[str, Any], args: argparse.Namespace) -> Built:
    xs, k = data["xs"], args.accumulation

    def backward(j: int) -> None:
        (model(xs[j]).square().mean() / k).backward()

    if name == "std_accum":
        opt = _adamw(model)

        def last() -> None:
            backward(k - 1)
            opt.step()
            opt.zero_grad(set_to_none=True)

        fns = [(lambda j=j: backward(j)) for j in range(k - 1)] + [last]
        return Built(fns, opt, lambda: {})
    if name == "inb_accum":
        opt = _inb(model, args, accumulation_steps=k)
        fns = [(lambda j=j: backward(j)) for j in range(k)]
        return Built(fns, opt, lambda: {**_policy_info(opt)(), "micro_batches_pending": opt.micro_batches})
    raise ValueError(name)


SCALER = (
    Variant("std_scaler", "scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()"),
    Variant("inb_scaler_exact", "grad_scaler=scaler; scaler.scale(loss).backward(); scaler.update()",
            reference="std_scaler", baseline="std_scaler", holds_grads=True),
    Variant("inb_scaler_per_bucket", "grad_scaler=scaler, overflow='per_bucket'; scaler.scale(loss).backward(); "
            "scaler.update()", reference="std_scaler", baseline="std_scaler"),
)
SCALER_RATIOS = (
    ("inb_scaler_exact", "std_scaler"),
    ("inb_scaler_per_bucket", "std_scaler"),
    ("inb_scaler_per_bucket", "inb_scaler_exact"),
)


def build_scaler(name: str, model: nn.Module, data: dict[str, Any], args: argparse.Namespace) -> Built:
    x = data["x"]
    scaler = torch.amp.GradScaler("cpu")

    def loss() -> torch.Tensor:
        return model(x).square().mean()

    if name == "std_scaler":
        opt = _adamw(model)

        def it() -> None:
            scaler.scale(loss()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return Built([it], opt, lambda: {"scale": scaler.get_scale()})
    overflow = {"inb_scaler_exact": "exact", "inb_scaler_per_bucket": "per_bucket"}[name]
    opt = _inb(model, args, grad_scaler=scaler, overflow=overflow)

    def it() -> None:
        scaler.scale(loss()).backward()
        scaler.update()

    return Built([it], opt, lambda: {**_policy_info(opt)(), "scale": scaler.get_scale()})


SECTIONS = {
    "clipping": ("Clipping at max_norm c (unit: one iteration)", CLIPPING, CLIPPING_RATIOS, build_clipping),
    "accumulation": ("Gradient accumulation (unit: one optimizer step of k micro-batches)", ACCUMULATION,
                     ACCUMULATION_RATIOS, build_accumulation),
    "grad_scaler": ("GradScaler('cpu') loop (unit: one iteration)", SCALER, SCALER_RATIOS, build_scaler),
}


# -- one section of one model ---------------------------------------------------------------------------------------
def _state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer, pa: list, pb: list) -> bool:
    for p, q in zip(pa, pb):
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        if sa.keys() != sb.keys():
            return False
        for key in sa:
            u, v = sa[key], sb[key]
            if isinstance(u, torch.Tensor) and not (isinstance(v, torch.Tensor) and torch.equal(u, v)):
                return False
    return True


def paired_delta_ms(timing: dict[str, Any], a: str, b: str) -> float:
    """Median over repetitions of a's time minus b's, in ms per unit."""
    return statistics.median(
        (x - y) * 1e3 for x, y in zip(timing[a]["samples_s"], timing[b]["samples_s"])
    )


class SectionBench:
    """The variants of one section on one model: built, warmed up, their memory measured; then timed."""

    def __init__(self, key: str, base: nn.Module, data: dict[str, Any], args: argparse.Namespace) -> None:
        self.key, self.base, self.args = key, base, args
        self.title, self.variants, self.ratio_pairs, builder = SECTIONS[key]
        self.names = tuple(v.name for v in self.variants)
        self.built: dict[str, Built] = {}
        self.models: dict[str, nn.Module] = {}
        for v in self.variants:
            m = copy.deepcopy(base)
            self.models[v.name] = m
            self.built[v.name] = builder(v.name, m, data, args)
        self.runs: dict[str, Fn] = {name: self._unit(b.micro_batches) for name, b in self.built.items()}
        # Warm-up: optimizer state, learned buckets, previous norm, allocator and kernels.
        for name in self.names:
            for _ in range(args.warmup):
                self.runs[name]()
        self.memory = {name: self._profile(self.built[name].micro_batches) for name in self.names}
        self.timing: dict[str, Any] = {}
        self.iters_per_block = 0

    @staticmethod
    def _unit(fns: list[Fn]) -> Fn:
        if len(fns) == 1:
            return fns[0]

        def unit() -> None:
            for f in fns:
                f()

        return unit

    @staticmethod
    def _profile(fns: list[Fn]) -> dict[str, Any]:
        """Peak of one unit above its start; per micro-batch too where there are several."""
        base, per_mb = 0, []
        for f in fns:
            r = profiled_peak(f)
            per_mb.append({"peak_bytes": base + r["peak_bytes"], "net_bytes": base + r["net_bytes"],
                           "events": r["events"]})
            base += r["net_bytes"]
        out: dict[str, Any] = {"peak_bytes": max(m["peak_bytes"] for m in per_mb), "net_bytes": base,
                               "events": sum(m["events"] for m in per_mb)}
        if len(fns) > 1:
            out["micro_batches"] = per_mb
        return out

    def time(self) -> None:
        k = len(next(iter(self.built.values())).micro_batches)
        args = argparse.Namespace(**{**vars(self.args), "iters": max(1, round(self.args.iters / k))})
        self.timing = time_interleaved(self.runs, args, self.names)
        self.iters_per_block = args.iters

    def result(self) -> dict[str, Any]:
        init = list(self.base.parameters())
        grad_bytes = sum(p.numel() * p.element_size() for p in init)
        variants: dict[str, Any] = {}
        for v in self.variants:
            ps = list(self.models[v.name].parameters())
            entry: dict[str, Any] = {
                "loop": v.loop, "in_backward": v.in_backward, "reference": v.reference, "baseline": v.baseline,
                "timing": self.timing[v.name], "memory": self.memory[v.name],
                "moved_from_init": any(not torch.equal(a, b) for a, b in zip(ps, init)),
                "grads_left": sum(p.grad is not None for p in ps),
                "info": self.built[v.name].info(),
            }
            if v.reference is not None:
                ref = list(self.models[v.reference].parameters())
                entry["agreement"] = {
                    "max_abs_diff": max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ps, ref)),
                    "params_bitwise_equal": all(torch.equal(a, b) for a, b in zip(ps, ref)),
                    "state_bitwise_equal": _state_equal(self.built[v.name].opt, self.built[v.reference].opt, ps,
                                                        ref),
                }
            if v.in_backward:
                buckets = bucket_bytes(self.built[v.name].opt)
                entry["buckets"] = {"count": len(buckets), "largest_bytes": max(buckets)}
            if v.baseline is not None:
                achieved = self.memory[v.baseline]["peak_bytes"] - self.memory[v.name]["peak_bytes"]
                # What stepping each bucket as it completes could save at most: every gradient but the largest
                # bucket's. Holding variants (and accumulation, whose gradients live from the first micro-batch
                # on) keep them all, so in theory they save nothing on the peak.
                theo = 0 if (v.holds_grads or self.key == "accumulation") else grad_bytes - max(buckets)
                entry["memory_saving"] = {
                    "vs": v.baseline, "achieved_bytes": achieved, "theoretical_bytes": theo,
                    "fraction": achieved / theo if theo > 0 else None,
                }
                if "micro_batches" in self.memory[v.name]:
                    entry["memory_saving"]["per_micro_batch_bytes"] = [
                        a["peak_bytes"] - b["peak_bytes"]
                        for a, b in zip(self.memory[v.baseline]["micro_batches"], self.memory[v.name]["micro_batches"])
                    ]
            variants[v.name] = entry
        ratios = {}
        for a, b in self.ratio_pairs:
            r = ratio(self.timing, a, b)
            r["paired_delta_ms"] = paired_delta_ms(self.timing, a, b)
            ratios[f"{a}/{b}"] = r
        return {"title": self.title, "micro_batches_per_unit": len(self.built[self.names[0]].micro_batches),
                "iters_per_block": self.iters_per_block, "grad_bytes": grad_bytes, "variants": variants,
                "ratios": ratios}


class ModelBench:
    def __init__(self, spec: dict[str, Any], args: argparse.Namespace) -> None:
        self.spec, self.args = spec, args
        torch.manual_seed(0)
        self.base = spec["build"]()
        data = {"x": torch.randn(args.batch, spec["in"]),
                "xs": [torch.randn(args.batch, spec["in"]) for _ in range(args.accumulation)]}
        self.sections = {key: SectionBench(key, self.base, data, args) for key in args.sections}

    def time(self) -> None:
        for s in self.sections.values():
            s.time()

    def result(self) -> dict[str, Any]:
        params = list(self.base.parameters())
        return {
            "description": self.spec["desc"], "batch": self.args.batch, "n_tensors": len(params),
            "n_params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "sections": {key: s.result() for key, s in self.sections.items()},
        }


# -- report ---------------------------------------------------------------------------------------------------------
def print_model(name: str, res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n=== {name}: {res['description']}; {res['n_tensors']} tensors, {_mib(res['grad_bytes'])} MiB of "
          f"gradients, batch {res['batch']}")
    for sec in res["sections"].values():
        title = sec["title"].replace("max_norm c", f"max_norm {args.max_norm:g}").replace(
            "k micro", f"{args.accumulation} micro")
        print(f"\n  -- {title}; {sec['iters_per_block']} unit(s) per timed block")
        print(f"    {'variant':<24}{'median ms':>10}{'p25':>8}{'p75':>8}{'peak MiB':>10}{'saving MiB':>11}"
              f"{'(theory)':>9}{'  = reference (bitwise)':<30}")
        for vname, v in sec["variants"].items():
            t = v["timing"]
            s = v.get("memory_saving")
            saving = f"{_mib(s['achieved_bytes']):>11}{_mib(s['theoretical_bytes']):>9}" if s else f"{'':>20}"
            if v["reference"]:
                ok = v["agreement"]["params_bitwise_equal"] and v["agreement"]["state_bitwise_equal"]
                agree = f"  {v['reference']}: {'yes' if ok else 'NO, max|dp| %.1e' % v['agreement']['max_abs_diff']}"
            else:
                agree = ""
            print(f"    {vname:<24}{t['median_s'] * 1e3:10.2f}{t['p25_s'] * 1e3:8.2f}{t['p75_s'] * 1e3:8.2f}"
                  f"{_mib(v['memory']['peak_bytes']):>10}{saving}{agree}")
        for vname, v in sec["variants"].items():
            mbs = v["memory"].get("micro_batches")
            if mbs:
                print(f"    {vname} peak per micro-batch (MiB above the step's start): "
                      + ", ".join(_mib(m["peak_bytes"]) for m in mbs))
        print(f"    {'ratio (time)':<48}{'of medians':>11}{'paired median (p25-p75)':>26}{'paired diff ms':>16}")
        for key, r in sec["ratios"].items():
            paired = f"{r['paired_median']:.3f} ({r['paired_p25']:.3f}-{r['paired_p75']:.3f})"
            print(f"      {key:<46}{r['of_medians']:11.3f}{paired:>26}{r['paired_delta_ms']:+16.2f}")
        infos = {k: v["info"] for k, v in sec["variants"].items() if v["info"]}
        if infos:
            print("    last step: " + "; ".join(
                f"{k}: " + ", ".join(f"{ik}={_fmt(iv)}" for ik, iv in info.items() if iv is not None)
                for k, info in infos.items()))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, float, float, str]]:
    """(model, variant, vs, paired time ratio, peak MiB saved vs the baseline, bitwise) for the compact table."""
    rows = []
    for mname, m in results["models"].items():
        for sec in m["sections"].values():
            for vname, v in sec["variants"].items():
                if not v["in_backward"]:
                    continue
                vs = v["baseline"]
                key = f"{vname}/{vs}"
                r = sec["ratios"].get(key)
                rows.append((mname, vname, vs, r["paired_median"] if r else float("nan"),
                             v["memory_saving"]["achieved_bytes"] / 2**20,
                             "yes" if v["agreement"]["params_bitwise_equal"] else "NO"))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, few repetitions (a smoke run of seconds)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON result file (default {DEFAULT_OUT})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: min(2, CPUs); quick: 1, as tiny ops gain nothing from a "
                        "second thread and a busy machine (tests running in parallel) makes its spin-waits very slow)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 25; quick 2)")
    p.add_argument("--iters", type=int, default=None,
                   help="backwards per timed block (default 3; quick 1); an accumulation block is one optimizer step "
                        "at least")
    p.add_argument("--warmup", type=int, default=None, help="warm-up units per variant (default 3; quick 2)")
    p.add_argument("--batch", type=int, default=8, help="input rows per micro-batch (default 8)")
    p.add_argument("--max-norm", type=float, default=None,
                   help="clipping threshold (default 1.0; quick: 0.05, below the tiny model's gradient norm, so that "
                        "the clipping is active and the bitwise checks exercise it)")
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="InBackwardOptimizer bucket_cap_mb (default: the engine's; quick: 0.05, several buckets)")
    p.add_argument("--malloc", choices=("pinned", "glibc"), default="pinned",
                   help="as bench_core: pinned keeps freed blocks in the heap (mallopt, glibc); default pinned")
    p.add_argument("--models", default="many_small", help="comma-separated: many_small, few_large (default many_small)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    a = p.parse_args(argv)
    a.threads = a.threads or (1 if a.quick else min(2, os.cpu_count() or 1))
    a.reps = a.reps or (2 if a.quick else 25)
    a.iters = a.iters or (1 if a.quick else 3)
    a.warmup = a.warmup or (2 if a.quick else 3)
    if a.max_norm is None:
        a.max_norm = 0.05 if a.quick else 1.0
    if a.bucket_cap_mb is None and a.quick:
        a.bucket_cap_mb = 0.05
    a.sections = [s for s in a.sections.split(",") if s]
    unknown = set(a.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}")
    if a.accumulation < 2:
        p.error("--accumulation must be >= 2")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wanted = [s for s in model_specs(args.quick) if s["name"] in args.models.split(",")]
    if not wanted:
        raise SystemExit(f"no known model in --models {args.models!r}")
    run = Run(args)
    pinned = run.pinned
    print(f"bench_training_loop ({'quick' if args.quick else 'full'}): torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, malloc {args.malloc if pinned or args.malloc == 'glibc' else 'as is'}, "
          f"{args.reps} interleaved reps, medians; AdamW(fused) lr {LR} wd {WEIGHT_DECAY}", flush=True)

    benches = {spec["name"]: ModelBench(spec, args) for spec in wanted}
    for bench in benches.values():
        bench.time()

    results: dict[str, Any] = {
        "benchmark": "bench_training_loop",
        "mode": "quick" if args.quick else "full",
        "config": {
            "threads": torch.get_num_threads(), "reps": args.reps, "backwards_per_block": args.iters,
            "warmup": args.warmup, "batch": args.batch, "lr": LR, "weight_decay": WEIGHT_DECAY,
            "max_norm": args.max_norm, "accumulation_steps": args.accumulation,
            "bucket_cap_mb": args.bucket_cap_mb if args.bucket_cap_mb is not None else "engine default",
            "malloc": args.malloc, "mallopt": pinned, "sections": args.sections,
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "models": {},
    }
    for name, bench in benches.items():
        res = bench.result()
        results["models"][name] = res
        print_model(name, res, args)

    print("\n=== summary: in-backward variant vs the standard loop users have (time: paired median ratio)")
    print(f"    {'model':<12}{'variant':<26}{'vs':<14}{'time':>7}{'peak saved MiB':>16}{'  bitwise = reference':<22}")
    for m, v, vs, r, saved, eq in summary_rows(results):
        print(f"    {m:<12}{v:<26}{vs:<14}{r:7.3f}{saved:16.2f}  {eq}")

    run.finish(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

"""Bytes per parameter of a training step: fp32 AdamW and torchao's 8-bit and 4-bit AdamW, in backward and in the
standard loop, with fp32 parameters, and bf16 parameters with 8-bit states rounded stochastically.

    python -m benchmarks.bench_bytes_per_param           # 100M parameters: 75 minutes on 2 busy cores
    python -m benchmarks.bench_bytes_per_param --quick   # a tiny model: torchao's compiles take most of it

One process. The model: ``--depth`` bias-free ``Linear(--width, --width)`` layers with a GELU between them, so that
every tensor takes torchao's quantised path (it keeps tensors under 4096 elements, biases and norms, in 32 bits).
Each configuration trains two copies of one initial model from the same random stream, the standard loop
(``loss.backward(); opt.step(); opt.zero_grad()``) and ``dist_optim.InBackwardOptimizer`` with the same class and
options, and measures, with the allocator's meters (``harness.allocator_peak``: torch.profiler's ``[memory]`` events
on CPU, ``max_memory_allocated`` on CUDA):

- persistent: the net bytes that building the model and the optimizer and running the first step leave allocated
  (the parameters and the optimizer states: quantised codes, their block scales and code maps), beside the same
  bytes counted tensor by tensor;
- step peak: the peak above that of one later step (forward, backward, the optimizer's step). It holds the
  activations, the gradients (all of them in the standard loop, the bucket being stepped in backward) and the step's
  own temporaries (torchao compiles one step per tensor, which holds fp32 copies of that tensor: measured apart, on
  the largest tensor alone);
- activations: the net bytes one forward leaves alive for its backward.

Bytes per parameter = (persistent + step peak - activations) / parameters: the activations are taken out whole,
though backward frees them as it goes, so the figure is a lower bound by at most activations / parameters (printed;
small at this batch). What stays beyond params + states is the largest bucket and one tensor's step temporaries in
backward, all gradients in the standard loop: ``floor`` (persistent / parameters) is what a model whose largest
tensor is a small share of it approaches. Agreement: parameters, states and losses after ``--steps`` steps, bitwise,
except with stochastic rounding, where each tensor's step draws random numbers and stepping bucket by bucket (in the
order gradients arrive) draws them for the tensors in another order than the standard loop: dist_optim refuses that
by default and accepts it with ``random_draws="reordered"`` (the variant ``in_backward_reordered_draws``), whose
difference is measured beside that of two standard loops from different seeds. Time: the paired ratio in backward /
standard of one configuration (``--time-config``), interleaved; printed, never asserted.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import dist_optim
from benchmarks import harness as h
from launch.optimizers import persistent_bytes, plain_tensors

LR, WEIGHT_DECAY = 1e-3, 0.01
TARGETS = {"adamw8bit": 6.2, "adamw4bit": 5.2, "adamw8bit_bf16_sr": 4.2}  # in backward, issue 23


def _torchao(name: str) -> Callable[[], type]:
    def load() -> type:
        import torchao.optim

        return getattr(torchao.optim, name)

    return load


# name -> (what it is, the class's loader, its options, the parameters' dtype)
CONFIGS: dict[str, tuple[str, Callable[[], type], dict[str, Any], torch.dtype]] = {
    "adamw": ("torch AdamW (fused), fp32 params", lambda: torch.optim.AdamW, {"fused": True}, torch.float32),
    "adamw8bit": ("torchao AdamW8bit, fp32 params", _torchao("AdamW8bit"), {}, torch.float32),
    "adamw4bit": ("torchao AdamW4bit, fp32 params", _torchao("AdamW4bit"), {}, torch.float32),
    "adamw8bit_bf16_sr": ("torchao AdamW8bit, bf16 params, stochastic rounding", _torchao("AdamW8bit"),
                          {"bf16_stochastic_round": True}, torch.bfloat16),
}
RANDOM = {"adamw8bit_bf16_sr"}  # configurations whose step draws random numbers


def build(args: Any, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(args.depth):
        layers += [nn.Linear(args.width, args.width, bias=False)] + ([nn.GELU()] if k < args.depth - 1 else [])
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


class Loop:
    """One model and optimizer, trained one way (a variant: the standard loop or in backward), with its own random
    stream (``with loop.stream():`` around its steps), so that loops trained in turn draw alike."""

    def __init__(self, variant: str, cls: type, kwargs: dict[str, Any], dtype: torch.dtype, args: Any,
                 device: torch.device, x: torch.Tensor) -> None:
        self.standard, self.x = variant == "standard", x
        self.model = build(args, dtype, device)
        self.params = list(self.model.parameters())
        opts = {"lr": LR, "weight_decay": WEIGHT_DECAY, **kwargs}
        if self.standard:
            self.opt = cls(self.params, **opts)
        else:
            cap = math.inf if variant == "in_backward_one_bucket" else args.bucket_cap_mb
            draws = "reordered" if variant == REORDERED else "exact"
            self.opt = dist_optim.InBackwardOptimizer(self.model, cls, bucket_cap_mb=cap, random_draws=draws, **opts)
        self.losses: list[float] = []
        self.rng: torch.Tensor | None = None  # None: the stream as it is when its steps start

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        saved = torch.get_rng_state()
        if self.rng is not None:
            torch.set_rng_state(self.rng)
        try:
            yield
        finally:
            self.rng = torch.get_rng_state()
            torch.set_rng_state(saved)

    def loss(self) -> torch.Tensor:
        return self.model(self.x).float().square().mean()

    def unit(self) -> None:
        loss = self.loss()
        if self.standard:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            self.opt.backward(loss)
        self.losses.append(loss.item())

    def units(self, n: int) -> None:
        with self.stream():
            for _ in range(n):
                self.unit()

    def state(self) -> list[torch.Tensor]:
        return [x for p in self.params for k, v in sorted(self.opt.state.get(p, {}).items()) for x in plain_tensors(v)]


REORDERED = "in_backward_reordered_draws"  # in backward with random_draws="reordered"


def agreement(a: Loop, b: Loop) -> dict[str, Any]:
    """``a`` against ``b`` after the same steps: parameters, states (a quantised one's codes and scales), losses,
    and where their random streams ended."""
    pa, pb = [p.detach() for p in a.params], [p.detach() for p in b.params]
    sa, sb = a.state(), b.state()
    diffs = [float((x.float() - y.float()).abs().max()) for x, y in zip(pa, pb)]
    return {"params_bitwise_equal": all(torch.equal(x, y) for x, y in zip(pa, pb)),
            "state_bitwise_equal": len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb)),
            "losses_bitwise_equal": a.losses == b.losses,
            "max_abs_param_diff": max(diffs), "max_abs_param": max(float(p.abs().max()) for p in pb),
            "params_differing_fraction": sum(int((x != y).sum()) for x, y in zip(pa, pb)) / sum(p.numel() for p in pa),
            "max_abs_loss_diff": max(abs(u - v) for u, v in zip(a.losses, b.losses)),
            "random_stream_ends_equal": a.rng is not None and b.rng is not None and torch.equal(a.rng, b.rng)}


def exact(a: dict[str, Any]) -> bool:
    return a["params_bitwise_equal"] and a["state_bitwise_equal"] and a["losses_bitwise_equal"]


def step_temporaries(cls: type, kwargs: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> int:
    """The allocator peak of one step of ``cls`` on one tensor of ``shape`` (its second step: states exist)."""
    p = nn.Parameter(torch.randn(shape, device=device).to(dtype))
    opt = cls([p], lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
    p.grad = torch.randn_like(p)
    opt.step()
    return h.allocator_peak(opt.step, device)["peak_bytes"]


def measure_loop(variant: str, cls: type, kwargs: dict[str, Any], dtype: torch.dtype, args: Any,
                 device: torch.device, x: torch.Tensor, seed: int = 1) -> tuple[Loop, dict[str, Any]]:
    """Build a loop and take its first step under the allocator's meter (what stays: parameters and states), then
    the peak of its second step."""
    made: list[Loop] = []

    def build_and_step() -> None:
        made.append(Loop(variant, cls, kwargs, dtype, args, device, x))
        torch.manual_seed(seed)  # every loop's random stream starts here
        made[0].unit()

    persistent = h.allocator_peak(build_and_step, device)
    loop = made[0]
    loop.rng = torch.get_rng_state()
    with loop.stream():
        step = h.allocator_peak(loop.unit, device)
    counted = persistent_bytes(loop.params, loop.opt)
    out = {"persistent_bytes": persistent["net_bytes"], "counted_bytes": counted,
           "other_persistent_bytes": persistent["net_bytes"] - counted["params"] - counted["states"],
           "step_peak_bytes": step["peak_bytes"], "step_net_bytes": step["net_bytes"]}
    if not loop.standard:
        out["largest_bucket_bytes"] = max(h.bucket_bytes(loop.opt))
        out["buckets"] = len(loop.opt.buckets)
    return loop, out


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:600]}"


def bench_config(name: str, args: Any, device: torch.device, timed: bool) -> dict[str, Any]:
    what, load, kwargs, dtype = CONFIGS[name]
    variants = ["standard", "in_backward"] + (["in_backward_one_bucket", REORDERED] if name in RANDOM else [])
    out: dict[str, Any] = {"what": what, "options": dict(kwargs), "dtype": str(dtype), "refused": {}}
    try:
        cls = load()
        temporaries = step_temporaries(cls, kwargs, (args.width, args.width), dtype, device)
    except Exception as e:  # noqa: BLE001 - not importable, or its compiled step fails on this machine
        return _skip(name, out, e)
    # warm-up on throwaway copies: torchao compiles its step per tensor shape here, outside the meters
    for variant in list(variants):
        try:
            warm = Loop(variant, cls, kwargs, dtype, args, device, _input(args, dtype, device))
            warm.units(args.warmup)
            del warm
        except NotImplementedError as e:  # dist_optim refuses it: recorded, not measured
            if variant == "standard":
                return _skip(name, out, e)
            out["refused"][variant] = _first_line(e)
            variants.remove(variant)
        except Exception as e:  # noqa: BLE001
            return _skip(name, out, e)
    x = _input(args, dtype, device)
    loops, memory = {}, {}
    for variant in variants:
        loops[variant], memory[variant] = measure_loop(variant, cls, kwargs, dtype, args, device, x)
    for loop in loops.values():
        loop.units(args.steps - 2)
    std = loops["standard"]
    n = sum(p.numel() for p in std.params)
    keep: list[torch.Tensor] = []
    activations = h.allocator_peak(lambda: keep.append(std.loss()), device)["net_bytes"]  # noqa: F821 (keep is deleted after the call)
    del keep
    for m in memory.values():
        m["bytes_per_param"] = (m["persistent_bytes"] + m["step_peak_bytes"] - activations) / n
        m["bytes_per_param_with_activations"] = (m["persistent_bytes"] + m["step_peak_bytes"]) / n
        m["floor_bytes_per_param"] = m["persistent_bytes"] / n
    out.update(params=n, param_bytes=h.nbytes(std.params), activation_bytes=activations,
               activations_per_param=activations / n, step_temporaries_bytes=temporaries,
               largest_tensor_share=args.width**2 / n, memory=memory, steps=args.steps,
               agreement={v: agreement(loops[v], std) for v in variants if v != "standard"})
    if name in TARGETS:
        steps_in_backward = [v for v in ("in_backward", REORDERED) if v in memory]
        out["target_in_backward"] = TARGETS[name]
        out["meets_target"] = {v: memory[v]["bytes_per_param"] <= TARGETS[name] for v in steps_in_backward}
    if name in RANDOM:
        out["random_draws"] = True
        # the spread stochastic rounding gives by itself: the standard loop from another random stream
        other, _ = measure_loop("standard", cls, kwargs, dtype, args, device, x, seed=2)
        other.units(args.steps - 2)
        out["standard_other_seed"] = agreement(other, std)
        del other
    if timed and "in_backward" in loops:
        t = h.time_interleaved({v: loops[v].unit for v in ("standard", "in_backward")}, args.repeats, args.iters,
                               device)
        out["timing"] = t
        out["time_ratio_in_backward_vs_standard"] = h.ratio(t, "in_backward", "standard")
    _print(name, out)
    return out


def _skip(name: str, out: dict[str, Any], e: BaseException) -> dict[str, Any]:
    out["skipped"] = _first_line(e)
    print(f"\n=== {name}: {out['what']}: SKIPPED ({out['skipped']})")
    if os.environ.get("BENCH_TRACEBACK"):
        traceback.print_exception(e)
    return out


def _input(args: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(args.batch, args.width, generator=g).to(device=device, dtype=dtype)


def _print(name: str, r: dict[str, Any]) -> None:
    n = r["params"]
    print(f"\n=== {name}: {r['what']}; {n / 1e6:.2f}M parameters ({h.mib(r['param_bytes'])} MiB), activations "
          f"{r['activations_per_param']:.3f} B/param, largest tensor {r['largest_tensor_share']:.2%} of them, its "
          f"step's temporaries {h.mib(r['step_temporaries_bytes'])} MiB")
    print(f"    {'variant':<28}{'B/param':>9}{'floor':>8}{'persistent MiB':>16}{'counted MiB':>13}"
          f"{'step peak MiB':>15}{'largest bucket MiB':>20}  equals standard (bitwise)")
    for variant, m in r["memory"].items():
        counted = m["counted_bytes"]["params"] + m["counted_bytes"]["states"]
        bucket = h.mib(m["largest_bucket_bytes"]) if "largest_bucket_bytes" in m else "(all grads)"
        a = r["agreement"].get(variant)
        eq = "" if a is None else "yes" if exact(a) else (
            f"NO: max |param diff| {a['max_abs_param_diff']:.3g}, {a['params_differing_fraction']:.2%} of elements, "
            f"max |loss diff| {a['max_abs_loss_diff']:.3g}")
        print(f"    {variant:<28}{m['bytes_per_param']:9.3f}{m['floor_bytes_per_param']:8.3f}"
              f"{h.mib(m['persistent_bytes']):>16}{h.mib(counted):>13}{h.mib(m['step_peak_bytes']):>15}{bucket:>20}"
              f"  {eq}")
    for variant, why in r["refused"].items():
        print(f"    {variant:<28}refused by dist_optim: {why}")
    o = r.get("standard_other_seed")
    if o:
        print(f"    standard from another seed, against standard: max |param diff| {o['max_abs_param_diff']:.3g}, "
              f"{o['params_differing_fraction']:.2%} of elements, max |loss diff| {o['max_abs_loss_diff']:.3g}")
    for variant, met in r.get("meets_target", {}).items():
        print(f"    {variant}: {r['memory'][variant]['bytes_per_param']:.3f} B/param, target <= "
              f"{r['target_in_backward']}: {'met' if met else 'NOT met'}")
    t = r.get("time_ratio_in_backward_vs_standard")
    if t:
        ms = {k: v["median_s"] * 1e3 for k, v in r["timing"].items()}
        print(f"    time: standard {ms['standard']:.2f} ms, in backward {ms['in_backward']:.2f} ms a step; in backward"
              f" / standard, paired median {t['paired_median']:.3f} ({t['paired_p25']:.3f}-{t['paired_p75']:.3f})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_bytes_per_param", __doc__)
    p.add_argument("--width", type=int, default=None, help="each Linear's width")
    p.add_argument("--depth", type=int, default=None, help="Linear layers")
    p.add_argument("--steps", type=int, default=None, help="steps each loop takes before they are compared (>= 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the engine's bucket_cap_mb")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--time-config", default=None, help="the configuration timed, in backward against standard")
    args = h.parse(p, argv,
                   quick={"threads": 1, "repeats": 2, "iters": 1, "warmup": 1, "width": 64, "depth": 4, "steps": 3,
                          "bucket_cap_mb": 0.02, "configs": ",".join(CONFIGS), "time_config": "adamw8bit"},
                   full={"threads": min(2, os.cpu_count() or 1), "repeats": 7, "iters": 1, "warmup": 2,
                         "width": 512, "depth": 384, "steps": 5, "bucket_cap_mb": 4.0,
                         "configs": ",".join(CONFIGS), "time_config": "adamw8bit"})
    chosen = args.configs.split(",")
    if not set(chosen) <= set(CONFIGS) or args.time_config not in CONFIGS:
        p.error(f"--configs and --time-config must name configurations among {', '.join(CONFIGS)}")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    run = h.Run("bench_bytes_per_param", args)
    device = h.device_of(args)
    configs = {name: bench_config(name, args, device, name == args.time_config) for name in chosen}
    _summary(configs)
    return run.finish({"configs": configs, "targets_in_backward": TARGETS})


def _summary(configs: dict[str, dict[str, Any]]) -> None:
    print("\nbytes per parameter (peak of a step minus activations):")
    for name, r in configs.items():
        if "skipped" in r:
            print(f"    {name:<20} skipped: {r['skipped']}")
            continue
        target = f" (target in backward <= {r['target_in_backward']})" if "target_in_backward" in r else ""
        each = ", ".join(f"{v} {m['bytes_per_param']:.3f}" for v, m in r["memory"].items())
        refused = "".join(f", {v} refused" for v in r["refused"])
        print(f"    {name:<20} {each}{refused}{target}")


if __name__ == "__main__":
    main()

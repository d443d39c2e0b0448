"""The memory planner (``dist_optim.plan()``) against measurement: planned and measured peaks of the same step.

    python -m benchmarks.bench_plan            # the trainer's GPT at 3 shapes x clip modes x bucket caps: minutes
    python -m benchmarks.bench_plan --quick    # seconds

One process, AdamW (fused, as the planner and the engine pick it), the trainer's GPT (launch/gpt.py) on random byte
sequences. For each configuration the planner traces a warm step on fake tensors; the same step (the planner's own
``Job``) then runs for real on a model of that shape, warm, its peak above the step's start measured by
``launch.memory_peak.allocator_peak`` (torch.profiler's memory events). Printed per loop: the planned and measured
peak (the resident bytes at the step's start, the same on both sides, plus the step's peak above it), the step's
own peak planned and measured, and the saving (standard peak - in-backward peak) planned and measured.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from benchmarks import harness as h
from dist_optim import plan
from dist_optim._planner._lowbit import storages
from dist_optim._planner._step import LOOPS, Job
from dist_optim._torch_internals import tree_leaves
from launch.gpt import GPT, loss_fn

VOCAB = 256
# name -> (n_layer, n_head, n_embd, block_size, batch): gradients set the peak (the README's --compare model, as
# bench_two_pass runs it), activations set it (the trainer's default shape), and a tiny one
SHAPES = {"gpt_512x4": (4, 8, 512, 32, 4), "gpt_128x4": (4, 4, 128, 128, 16), "gpt_64x2": (2, 2, 64, 32, 4)}
QUICK_SHAPES = {"gpt_64x2": SHAPES["gpt_64x2"]}
# (label, engine options)
CONFIGS = [
    ("none", {}),
    ("exact", {"max_grad_norm": 0.05, "clip_mode": "exact"}),
    ("two_pass", {"max_grad_norm": 0.05, "clip_mode": "two_pass"}),
    ("per_parameter", {"max_grad_norm": 0.05, "clip_mode": "per_parameter"}),
    ("none, cap 1 MiB", {"bucket_cap_mb": 1.0}),
    ("none, cap inf", {"bucket_cap_mb": math.inf}),
]
OPTIMIZER_KWARGS = {"lr": h.LR, "weight_decay": h.WEIGHT_DECAY}


def _builders(shape: tuple[int, int, int, int, int], device: str = "cpu") -> tuple[Any, Any, Any]:
    n_layer, n_head, n_embd, block, batch = shape

    def model_fn() -> GPT:
        with torch.device(device):  # built there: fake parameters cannot be moved by .to()
            return GPT(VOCAB, block, n_layer, n_head, n_embd, tie_weights=False)

    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, VOCAB, (batch, block), device=device),
                torch.randint(0, VOCAB, (batch, block), device=device))

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(model(b[0]), b[1])

    return model_fn, batch_fn, loss


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors`` (a subclass's inner tensors: torchao's low-bit state), once each."""
    return sum({id(st): st.nbytes() for t in tensors for st in storages(t)}.values())


def measured(shape: tuple[int, int, int, int, int], engine: dict[str, Any], device: str = "cpu",
             autocast_dtype: torch.dtype | None = None) -> dict[str, dict[str, int]]:
    """Each loop's warm step of the GPT of ``shape`` run for real (:func:`measure`)."""
    return measure(*_builders(shape, device), torch.optim.AdamW, OPTIMIZER_KWARGS, engine, device, autocast_dtype)


def measure(model_fn: Any, batch_fn: Any, loss: Any, optimizer_class: type, optimizer_kwargs: dict[str, Any],
            engine: dict[str, Any], device: str = "cpu", autocast_dtype: torch.dtype | None = None
            ) -> dict[str, dict[str, int]]:
    """Each loop's warm step run for real: the resident bytes at its start and its allocator peak above them
    (CPU: the profiler's memory events; CUDA: ``max_memory_allocated``)."""
    micro = engine.get("accumulation_steps", 1)
    out = {}
    for loop in LOOPS:
        torch.manual_seed(0)
        job = Job(model_fn(), loop, loss, optimizer_class, optimizer_kwargs, engine)
        job.autocast = autocast_dtype
        job.step([batch_fn() for _ in range(micro)])
        batches = [batch_fn() for _ in range(micro)]
        start = _storage_bytes(job.resident() + [t for t in tree_leaves(batches) if isinstance(t, torch.Tensor)])
        step = h.allocator_peak(lambda: job.step(batches), device)["peak_bytes"]
        out[loop] = {"start_bytes": start, "step_peak_bytes": step, "peak_bytes": start + step}
    return out


def compare(shape: tuple[int, int, int, int, int], engine: dict[str, Any], device: str = "cpu",
            autocast_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Planned against measured for the GPT of ``shape`` (:func:`compare_job`)."""
    return compare_job(*_builders(shape, device), torch.optim.AdamW, OPTIMIZER_KWARGS, engine, device,
                       autocast_dtype)


def compare_job(model_fn: Any, batch_fn: Any, loss: Any, optimizer_class: type, optimizer_kwargs: dict[str, Any],
                engine: dict[str, Any], device: str = "cpu", autocast_dtype: torch.dtype | None = None
                ) -> dict[str, Any]:
    """Planned against measured for one job; ``error`` is (planned - measured) / measured."""
    p = plan(model_fn, batch_fn, loss, optimizer_class, **engine, autocast_dtype=autocast_dtype, **optimizer_kwargs)
    m = measure(model_fn, batch_fn, loss, optimizer_class, optimizer_kwargs, engine, device, autocast_dtype)
    res: dict[str, Any] = {"engine": {k: v if v != math.inf else "inf" for k, v in engine.items()},
                           "not_seen": list(p.not_seen)}
    for lp in p.loops():
        got = m[lp.loop]
        res[lp.loop] = {"planned_peak": lp.peak_bytes, "measured_peak": got["peak_bytes"],
                        "planned_step_peak": lp.step_peak_bytes, "measured_step_peak": got["step_peak_bytes"],
                        "breakdown": lp.breakdown, "error": lp.peak_bytes / got["peak_bytes"] - 1,
                        "step_error": lp.step_peak_bytes / max(1, got["step_peak_bytes"]) - 1}
    saving_m = m["standard"]["peak_bytes"] - m["in_backward"]["peak_bytes"]
    res["saving"] = {"planned": p.saving_bytes, "measured": saving_m,
                     "error": (p.saving_bytes - saving_m) / saving_m if saving_m else None}
    return res


def print_rows(label: str, r: dict[str, Any]) -> None:
    """One line per loop of a :func:`compare_job` result: peaks planned and measured, the step's, the saving."""
    s = r["saving"]
    for loop in LOOPS:
        x = r[loop]
        err = "" if s["error"] is None else f" ({100 * s['error']:+.1f} %)"
        tail = f"   {h.mib(s['planned'])} / {h.mib(s['measured'])}{err}" if loop == "standard" else ""
        print(f"{label} {loop:<12} {h.mib(x['planned_peak']):>9} {h.mib(x['measured_peak']):>9} "
              f"{100 * x['error']:>+6.1f}%  {h.mib(x['planned_step_peak']):>12} {h.mib(x['measured_step_peak']):>9}{tail}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser("bench_plan", __doc__)
    args = h.parse(p, argv, quick={"threads": 1}, full={"threads": 2})
    run = h.Run("bench_plan", args)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    configs = CONFIGS[:3] if args.quick else CONFIGS
    rows = {}
    print(f"{'model':<10} {'clipping, cap':<16} {'loop':<12} {'planned':>9} {'measured':>9} {'err':>7}  "
          f"{'step planned':>12} {'measured':>9}   saving planned / measured MiB")
    for name, shape in shapes.items():
        for label, engine in configs:
            rows[f"{name}/{label}"] = compare(shape, engine, args.device)
            print_rows(f"{name:<10} {label:<16}", rows[f"{name}/{label}"])
    return run.finish({"shapes": {k: list(v) for k, v in shapes.items()}, "rows": rows})


if __name__ == "__main__":
    main()

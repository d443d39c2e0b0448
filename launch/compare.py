"""``--compare``: the same job trained with the standard loop and in backward, side by side, and a report.

Both jobs start from the same seed and see the same batches; their steps are interleaved (the order alternates
every step) so that the machine's drift touches both alike. Reported: the two loss curves and their largest
difference (0 where the arithmetic is the same), the median step time of each and their paired ratio, and each
rank's memory peak over one step: on CPU from torch.profiler's ``[memory]`` events (running sum of the allocator's
signed deltas: :func:`launch.memory_peak.allocator_peak`, the benchmarks' meter too), on CUDA
``torch.cuda.max_memory_allocated``. The profiler sees the profiled thread only: under FSDP2 gloo's own threads
allocate and free some blocks too, which shows as a non-zero "net" (reported), so read FSDP2's CPU peaks to about
that much.
"""

from __future__ import annotations

import json
import logging
import pathlib
import statistics
from typing import Any

from .memory_peak import allocator_peak
from .optimizers import bytes_markdown, bytes_per_param, persistent_bytes
from .runtime import Runtime
from .train_config import TrainConfig
from .train_loop import Job

__all__ = ["compare"]

log = logging.getLogger("train")
MODES = ("standard", "in_backward")
MiB = 2**20


def profiled_step(job: Job, step: int) -> tuple[Any, dict[str, Any]]:
    """Run ``job.step(step)`` under the allocator's peak measure (the benchmarks' own): (its result, peak/net
    bytes above the start and the timeline of allocated bytes)."""
    out: list[Any] = []
    memory = allocator_peak(lambda: out.append(job.step(step)), job.rt.device, timeline=True)
    timeline = memory["timeline"]
    if len(timeline) > 400:  # enough points for a plot
        stride = len(timeline) // 400 + 1
        memory["timeline"] = timeline[::stride] + [timeline[-1]]
    return out[0], memory


def _grad_bytes(job: Job) -> int:
    """Bytes of this rank's gradients for one step (the local shards under FSDP2)."""
    total = 0
    for p in job.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def compare(cfg: TrainConfig, rt: Runtime, parallel: str, corpus) -> dict[str, Any]:
    """Train both jobs and write RUN_DIR/compare/{report.json, report.md, compare.png}. Collective."""
    jobs = {mode: Job(cfg, rt, corpus, parallel, mode) for mode in MODES}
    profile_at = cfg.steps - 1 if cfg.profile_step < 0 else min(cfg.profile_step, cfg.steps - 1)
    results: dict[str, list] = {mode: [] for mode in MODES}
    memory: dict[str, dict] = {}
    if rt.is_main:
        log.info("compare: %d process(es), %s, %.2fM parameters, %d steps, memory profiled at step %d", rt.world,
                 parallel, jobs["standard"].n_params / 1e6, cfg.steps, profile_at)
    for step in range(cfg.steps):
        for mode in MODES if step % 2 == 0 else reversed(MODES):
            if step == profile_at:
                res, memory[mode] = profiled_step(jobs[mode], step)
            else:
                res = jobs[mode].step(step)
            results[mode].append(res)
        if rt.is_main and step % cfg.log_every == 0:
            a, b = (results[m][-1] for m in MODES)
            log.info("step %5d  loss standard %.6f  in-backward %.6f  step time %.1f / %.1f ms", step, a.loss,
                     b.loss, a.seconds * 1e3, b.seconds * 1e3)
    # every rank's peaks, gathered for rank 0's report
    per_rank = rt.all_gather({m: {k: v for k, v in memory[m].items() if k != "timeline"} for m in MODES})
    grad_bytes = rt.all_gather(_grad_bytes(jobs["in_backward"]))
    report = _report(cfg, rt, parallel, results, per_rank, grad_bytes, profile_at)
    held = rt.all_gather({m: persistent_bytes(list(jobs[m].model.parameters()), jobs[m].opt) for m in MODES})
    report.update(bytes_per_param(held, report["peak_memory_bytes_per_rank"]))
    if rt.is_main:
        out = pathlib.Path(cfg.run_dir) / "compare"
        out.mkdir(parents=True, exist_ok=True)
        _plot(out / "compare.png", _panels(results, memory, report))
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "report.md").write_text(_markdown(report))
        log.info("%s", _summary(report))
        log.info("report: %s", out / "report.md")
    return report


def _report(cfg, rt, parallel, results, per_rank, grad_bytes, profile_at) -> dict[str, Any]:
    losses = {m: [r.loss for r in results[m]] for m in MODES}
    diffs = [abs(a - b) for a, b in zip(losses["standard"], losses["in_backward"])]
    # step 0 warms up and the profiled step is slowed by the profiler: neither is timed
    timed = [k for k in range(cfg.steps) if k != 0 and k != profile_at] or list(range(cfg.steps))
    times = {m: [results[m][k].seconds for k in timed] for m in MODES}
    ratios = [b / a for a, b in zip(times["standard"], times["in_backward"])]
    return {
        "world_size": rt.world, "parallel": parallel, "device": str(rt.device), "steps": cfg.steps,
        "config": cfg.to_dict(),
        "losses": losses,
        "grad_norms": {m: [r.grad_norm for r in results[m]] for m in MODES},
        "max_abs_loss_diff": max(diffs),
        "losses_bitwise_equal": losses["standard"] == losses["in_backward"],
        "step_time_median_s": {m: statistics.median(times[m]) for m in MODES},
        "step_time_ratio_in_backward_vs_standard": statistics.median(ratios),
        "memory_profiled_step": profile_at,
        "peak_memory_bytes_per_rank": {m: [r[m]["peak_bytes"] for r in per_rank] for m in MODES},
        "memory_net_bytes_per_rank": {m: [r[m]["net_bytes"] for r in per_rank] for m in MODES},
        "memory_source": per_rank[0]["standard"]["source"],
        "gradient_bytes_per_rank": grad_bytes,
    }


def _summary(r: dict[str, Any]) -> str:
    peaks = r["peak_memory_bytes_per_rank"]
    per_rank = ", ".join(f"rank {k}: {a / MiB:.2f} -> {b / MiB:.2f} MiB"
                         for k, (a, b) in enumerate(zip(peaks["standard"], peaks["in_backward"])))
    return (f"losses max |diff| {r['max_abs_loss_diff']:.3g} (bitwise equal: {r['losses_bitwise_equal']}); step time "
            f"in-backward / standard {r['step_time_ratio_in_backward_vs_standard']:.3f}; peak memory standard -> "
            f"in-backward: {per_rank}")


def _markdown(r: dict[str, Any]) -> str:
    peaks, net = r["peak_memory_bytes_per_rank"], r["memory_net_bytes_per_rank"]
    t = r["step_time_median_s"]
    rows = "\n".join(
        f"| {k} | {a / MiB:.3f} | {b / MiB:.3f} | {(a - b) / MiB:+.3f} | {r['gradient_bytes_per_rank'][k] / MiB:.3f} "
        f"| {net['standard'][k] / MiB:.3f} / {net['in_backward'][k] / MiB:.3f} |"
        for k, (a, b) in enumerate(zip(peaks["standard"], peaks["in_backward"]))
    )
    return f"""# Standard loop vs in-backward

{r['world_size']} process(es), `{r['parallel']}` on {r['device']}, {r['steps']} steps, same seed and batches.

## Loss

Max |loss difference| over {r['steps']} steps: **{r['max_abs_loss_diff']:.3g}** (bitwise equal:
{r['losses_bitwise_equal']}). Final loss: standard {r['losses']['standard'][-1]:.6f}, in-backward
{r['losses']['in_backward'][-1]:.6f}.

## Step time

Median step: standard {t['standard'] * 1e3:.2f} ms, in-backward {t['in_backward'] * 1e3:.2f} ms; paired median
ratio in-backward / standard: **{r['step_time_ratio_in_backward_vs_standard']:.3f}** (steps interleaved; step 0
and the profiled step not timed).

## Peak memory of step {r['memory_profiled_step']}, per rank ({r['memory_source']})

| rank | standard MiB | in-backward MiB | saved MiB | gradient MiB (local) | net after step, std / in-bwd MiB |
|---|---|---|---|---|---|
{rows}

{bytes_markdown(r)}
Plot: `compare.png` (both loss curves, drawn so that coinciding ones stay visible, and their difference per step;
each loop's allocated bytes above the step's start during the profiled step, rank 0, on one scale from 0, with
the forward, backward and step phases shaded).
"""


STYLES = {"standard": {"marker": "o", "markerfacecolor": "none", "linewidth": 2.5, "alpha": 0.6},
          "in_backward": {"marker": "x", "linestyle": "--", "linewidth": 1.2}}  # both visible where they coincide


def _panels(results, memory, report) -> list[dict[str, Any]]:
    steps = [r.step for r in results["standard"]]
    labels = {"standard": "standard loop", "in_backward": "in backward"}
    diff = [b.loss - a.loss for a, b in zip(results["standard"], results["in_backward"])]
    return [
        {"title": f"Loss per step (max abs diff {report['max_abs_loss_diff']:.3g})", "xlabel": "step",
         "ylabel": "loss", "series": [(labels[m], steps, [r.loss for r in results[m]], STYLES[m]) for m in MODES]},
        {"title": "Loss difference, in backward - standard", "xlabel": "step", "ylabel": "loss difference",
         "series": [("in backward - standard" + (" (bitwise equal: 0 everywhere)" if not any(diff) else ""), steps,
                     diff, {"marker": "."})]},
        *({"title": f"Memory during step {report['memory_profiled_step']}, rank 0: {labels[m]}",
           "xlabel": "time in the step, ms", "ylabel": "allocated above the step's start, MiB",
           "ylim": max(memory[k]["peak_bytes"] for k in MODES) / MiB * 1.1,
           "spans": [(name, a * 1e3, b * 1e3) for name, a, b in memory[m].get("phases", [])],
           "series": [(f"peak {memory[m]['peak_bytes'] / MiB:.2f} MiB", [t * 1e3 for t, _ in memory[m]["timeline"]],
                       [b / MiB for _, b in memory[m]["timeline"]], {})]} for m in MODES),
    ]


def _plot(path: pathlib.Path, panels: list[dict[str, Any]]) -> None:
    """The panels side by side in one PNG (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4 * rows), squeeze=False)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green"}
    for ax, panel in zip(axes.flat, panels):
        for name, a, b in panel.get("spans", []):  # the phases, shaded, each named once in the legend
            ax.axvspan(a, b, color=colors.get(name, "grey"), alpha=0.15,
                       label=name if name not in ax.get_legend_handles_labels()[1] else None)
        for label, xs, ys, style in panel["series"]:
            ax.plot(xs, ys, label=label, markersize=4, **style)
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"])
        if "ylim" in panel:
            ax.set_ylim(0, panel["ylim"])  # from 0, the same scale for both loops
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

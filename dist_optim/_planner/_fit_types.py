"""What ``dist_optim.fit`` searches and returns: a setting (:class:`FitSetting`), its planned peak and estimated
cost (:class:`FitCandidate`), and the ranked result (:class:`FitResult`), with the cost model's device figures.

The search itself is ``_fit``; this module imports nothing of the planner.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

__all__: list[str] = []

MiB, GiB = 2**20, 2**30
# what a user widens the search to: each changes the job's arithmetic against the job asked for (fp32, full state)
ALLOW = ("bf16-params", "autocast", "low-bit-states", "reordered-draws")
# peak dense FLOP/s in fp32 and bf16, and bytes/s of the link within a node and across nodes: the cost model's
# device (published figures; the ranking depends on their ratios, not on their size)
DEVICES = {
    "h100": (67e12, 989e12, 450e9, 50e9),
    "a100": (19.5e12, 312e12, 300e9, 25e9),
    "l4": (30e12, 121e12, 32e9, 12.5e9),
    "cpu": (2e11, 2e11, 5e9, 1e9),
}


@dataclass(frozen=True)
class FitSetting:
    """One configuration of the job: its layout over the world, its micro-batching, and its memory settings."""

    parallel: str = "none"  # none, ddp, fsdp2, hsdp, tp, fsdp2+tp
    world_size: int = 1
    tp_size: int | None = None  # tp, fsdp2+tp: tensor-parallel ranks per replica
    shard_size: int | None = None  # hsdp: the ranks a replica is sharded over
    micro_batch: int = 1  # samples per micro-batch on one data-parallel rank
    accumulation_steps: int = 1  # micro-batches per optimizer step
    checkpoint_blocks: int = 0  # blocks whose activations are recomputed in backward
    param_dtype: str = "float32"
    autocast: str | None = None
    state: str = "full"  # the optimizer state's precision: full, 8bit, 4bit (torchao)
    clip_mode: str | None = None  # with max_grad_norm: exact or two_pass
    bucket_cap_mb: float | None = None  # None: the engine's default
    random_draws: str = "exact"  # "reordered": a class that draws random numbers may step in buckets (no memory)

    def needs(self) -> tuple[str, ...]:
        """The ``allow`` names this setting needs (empty: bitwise the job asked for, laid out so)."""
        return tuple(n for n, on in (("bf16-params", self.param_dtype != "float32"),
                                     ("autocast", self.autocast is not None),
                                     ("low-bit-states", self.state != "full"),
                                     ("reordered-draws", self.random_draws != "exact")) if on)

    def describe(self) -> str:
        layout = {"none": "one device", "ddp": f"DDP x{self.world_size}", "fsdp2": f"FSDP2 x{self.world_size}",
                  "hsdp": f"HSDP {self.world_size // (self.shard_size or 1)}x{self.shard_size}",
                  "tp": f"TP x{self.world_size}",
                  "fsdp2+tp": f"FSDP2 x{self.world_size // (self.tp_size or 1)} x TP {self.tp_size}"}[self.parallel]
        parts = [layout, f"micro {self.micro_batch} x {self.accumulation_steps}"]
        if self.checkpoint_blocks:
            parts.append(f"ckpt {self.checkpoint_blocks}")
        if self.param_dtype != "float32":
            parts.append(self.param_dtype)
        if self.autocast:
            parts.append(f"autocast {self.autocast}")
        if self.state != "full":
            parts.append(f"{self.state} states")
        if self.clip_mode:
            parts.append(f"clip {self.clip_mode}")
        if self.bucket_cap_mb is not None:
            parts.append(f"cap {self.bucket_cap_mb:g} MiB")
        if self.random_draws != "exact":
            parts.append(f"draws {self.random_draws}")
        return ", ".join(parts)


@dataclass
class FitCandidate:
    """A setting with its planned peak per device (the larger of the first and a warm step, bytes), how that was
    found (``"traced"``: the setting itself on fake tensors; ``"derived"``: from traced settings' parts, see
    docs/planning.md; ``"bound"``: its parameters alone exceed the budget), and its estimated step time."""

    setting: FitSetting
    planned_peak_bytes: int
    planned_by: str
    fits: bool = False
    flops: float = 0.0  # one optimizer step on one device
    collective_bytes: float = 0.0
    cost_seconds: float = 0.0
    argv: list[str] = field(default_factory=list)  # the trainer's flags (launch.train --fit), else empty
    call: str = ""  # dist_optim.fit: how to run it (the layout, the model's settings, the optimizer's call)

    def to_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "call": self.call, "planned_peak_bytes": self.planned_peak_bytes, "fits": self.fits,
                "planned_by": self.planned_by, "cost_seconds": self.cost_seconds, "flops": self.flops,
                "collective_bytes": self.collective_bytes, "needs": list(self.setting.needs()),
                "setting": dataclasses.asdict(self.setting), "describe": self.setting.describe()}


@dataclass
class FitResult:
    """The search's outcome: every candidate, those that fit first (cheapest first), then the others (smallest
    peak first)."""

    budget_bytes: int
    headroom: float  # the fraction of the budget kept for what the plan cannot see
    candidates: list[FitCandidate]
    device: str
    traces: int  # settings traced on fake tensors
    seconds: float
    skipped: list[str] = field(default_factory=list)  # layouts the world or the batch rule out, and why

    @property
    def usable_bytes(self) -> int:
        return int(self.budget_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        return bool(self.candidates) and self.candidates[0].fits

    @property
    def best(self) -> FitCandidate | None:
        return self.candidates[0] if self.fits else None

    @property
    def smallest_peak_bytes(self) -> int:
        """The least memory any candidate plans (its budget then is this over ``1 - headroom``); a bound (the
        parameters and state alone) is not a plan, and counts only where nothing else was planned."""
        planned = [c.planned_peak_bytes for c in self.candidates if c.planned_by != "bound"]
        return min(planned or [c.planned_peak_bytes for c in self.candidates])

    def smallest_budget_bytes(self) -> int:
        return -(-self.smallest_peak_bytes * 100 // round(100 * (1 - self.headroom)))

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"fits": self.fits, "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes,
                "headroom": self.headroom, "planned_peak_bytes": best.planned_peak_bytes if best else None,
                "argv": best.argv if best else None, "smallest_peak_bytes": self.smallest_peak_bytes,
                "smallest_budget_bytes": self.smallest_budget_bytes(), "device": self.device,
                "traces": self.traces, "seconds": self.seconds, "skipped": self.skipped,
                "candidates": [c.to_dict() for c in self.candidates]}

    def table(self, rows: int = 8) -> str:
        """The best ``rows`` candidates that fit (or, with none, the smallest), in GiB/MiB, with relative cost."""
        unit, name = (GiB, "GiB") if self.budget_bytes >= 4 * GiB else (MiB, "MiB")
        fitting = [c for c in self.candidates if c.fits]
        shown = (fitting or self.candidates)[:rows]
        base = min((c.cost_seconds for c in fitting), default=0.0) or 1.0
        lines = [f"{'#':>2}  {'peak ' + name:>10}  {'headroom':>8}  {'cost':>6}  {'by':<7}  setting"]
        for i, c in enumerate(shown, 1):
            spare = self.budget_bytes - c.planned_peak_bytes
            lines.append(f"{i:>2}  {c.planned_peak_bytes / unit:>10.2f}  {100 * spare / self.budget_bytes:>7.1f}%  "
                         f"{c.cost_seconds / base:>5.2f}x  {c.planned_by:<7}  {c.setting.describe()}"
                         + (f"  (needs {', '.join(c.setting.needs())})" if c.setting.needs() else ""))
        over = len(self.candidates) - len(fitting)
        lines.append(f"{len(fitting)} of {len(self.candidates)} candidates fit {self.budget_bytes / unit:.2f} {name} "
                     f"less {100 * self.headroom:.0f} % headroom ({over} over); {self.traces} traced in "
                     f"{self.seconds:.1f} s; cost: estimated step time on {self.device}, relative to the best")
        if not fitting:
            lines.append(f"nothing fits: the smallest candidate plans {self.smallest_peak_bytes / unit:.2f} {name}, "
                         f"a budget of at least {self.smallest_budget_bytes() / unit:.2f} {name}")
        lines += [f"skipped: {why}" for why in self.skipped]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG: each candidate's planned peak against its relative cost, the budget and its headroom drawn
        (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        base = min((c.cost_seconds for c in self.candidates if c.fits), default=0.0) or 1.0
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "over the budget")):
            pts = [(c.cost_seconds / base, c.planned_peak_bytes / GiB) for c in self.candidates if c.fits == fits]
            if pts:
                ax.scatter(*zip(*pts), s=14, c=colour, label=label)
        ax.axhline(self.budget_bytes / GiB, color="k", lw=1, label="budget")
        ax.axhline(self.usable_bytes / GiB, color="k", lw=1, ls="--", label=f"budget less {self.headroom:.0%}")
        if self.best is not None:
            ax.scatter([self.best.cost_seconds / base], [self.best.planned_peak_bytes / GiB], s=80,
                       facecolors="none", edgecolors="k", label="chosen")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("estimated step time, relative to the best that fits")
        ax.set_ylabel("planned peak per device (GiB)")
        ax.set_title(f"fit: {sum(c.fits for c in self.candidates)} of {len(self.candidates)} candidates fit")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_memory(value: int | float | str) -> int:
    """Bytes from ``80GiB``, ``512 MiB``, ``24GB`` or a number of bytes; a ValueError naming the forms."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory must be a positive size such as 80GiB, 512MiB, 24GB or a number of bytes, got "
                         f"{value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])

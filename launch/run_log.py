"""What a run reports, on rank 0 only: a progress line per step, ``metrics.jsonl`` (one JSON object per step) in
the run directory, and, when asked for, TensorBoard events (``--tensorboard``) and a Weights & Biases run
(``--wandb PROJECT``); a missing package is one line naming the extra that installs it."""

from __future__ import annotations

import importlib
import json
import logging
import pathlib
from dataclasses import asdict
from typing import Any

from .runtime import LaunchError

__all__ = ["RunLog", "check_reporters", "read_metrics"]

log = logging.getLogger("train")


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLog:
    """Per-step records of one run. ``resume_step``: the records after it (from a run that went further before
    stopping) are dropped, so that the file reads as one uninterrupted run."""

    def __init__(self, run_dir: str, enabled: bool, log_every: int, resume_step: int | None = None,
                 last_step: int | None = None, tensorboard: bool = False, wandb: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.enabled, self.log_every = enabled, log_every
        self.last_step = last_step  # the run's last step, for the progress line's time left
        self._seconds: list[float] = []  # the steps' times in this process run
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if resume_step is not None and r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            self._tb = _tensorboard(self.path.parent / "tensorboard", resume_step)
        if wandb is not None:
            self._wandb = _wandb(wandb, self.path.parent, config or {})

    def record(self, result: Any, **extra: Any) -> None:
        if not self.enabled:
            return
        rec = {**asdict(result), **extra, "tokens_per_s": result.tokens / result.seconds}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        scalars = {f"train/{k}": rec[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s") if rec.get(k) is not None}
        for key in ("grad_bytes_peak", "memory_peak_bytes"):  # per rank: the largest
            if rec.get(key):
                scalars[f"memory/{key}_max_rank"] = max(rec[key])
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, rec["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])
        self._seconds.append(result.seconds)
        if result.step % self.log_every == 0:
            norm = "" if result.grad_norm is None else f"  grad_norm {result.grad_norm:.4f}"
            log.info("step %5d  loss %.4f  %8.0f tok/s%s  lr %.3e%s", result.step, result.loss, rec["tokens_per_s"],
                     norm, result.lr, self._time_left(result.step))

    def _time_left(self, step: int) -> str:
        """``  eta 1:23`` from the median of the last steps' times (the first, which builds state, left out once
        there are others); empty at the last step."""
        if self.last_step is None or step >= self.last_step:
            return ""
        recent = sorted(self._seconds[1:][-20:] or self._seconds)
        seconds = int(recent[len(recent) // 2] * (self.last_step - step))
        return f"  eta {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tensorboard(directory: pathlib.Path, resume_step: int | None) -> Any:
    writer = _import("torch.utils.tensorboard", "--tensorboard needs TensorBoard", "tensorboard").SummaryWriter
    return writer(str(directory), purge_step=resume_step)


def _wandb(project: str, run_dir: pathlib.Path, config: dict[str, Any]) -> Any:
    wandb = _import("wandb", f"--wandb {project} needs Weights & Biases", "wandb")
    return wandb.init(project=project, dir=str(run_dir), config=config, name=run_dir.name, resume="allow")


def check_reporters(tensorboard: bool, wandb: str | None) -> None:
    """The packages --tensorboard and --wandb need, importable; checked on every rank before anything runs."""
    if tensorboard:
        _import("torch.utils.tensorboard", "--tensorboard needs TensorBoard", "tensorboard")
    if wandb is not None:
        _import("wandb", f"--wandb {wandb} needs Weights & Biases", "wandb")


def _import(module: str, what: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LaunchError(f"{what}, which is not installed: pip install -c constraints.txt -e '.[{extra}]' (or drop "
                          f"--{extra})") from e

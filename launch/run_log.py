"""What a run reports, on rank 0 only: a progress line per step, ``metrics.jsonl`` (one JSON object per step) in
the run directory, and TensorBoard events when ``torch.utils.tensorboard`` can be imported (skipped otherwise)."""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import asdict
from typing import Any

__all__ = ["RunLog", "read_metrics"]

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
                 last_step: int | None = None) -> None:
        self.enabled, self.log_every = enabled, log_every
        self.last_step = last_step  # the run's last step, for the progress line's time left
        self._seconds: list[float] = []  # the steps' times in this process run
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if resume_step is not None and r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # TensorBoard is optional
            return
        self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=resume_step)

    def record(self, result: Any, **extra: Any) -> None:
        if not self.enabled:
            return
        rec = {**asdict(result), **extra, "tokens_per_s": result.tokens / result.seconds}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if rec.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", rec[key], rec["step"])
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

"""Checkpoints of a run: one small adapter over ``dist_optim.checkpoint.CheckpointManager`` (sharded, resumable on
any number of processes), so that the training loop has exactly two calls: :func:`save` and :func:`load`.

Until that module exists, a stand-in with the same contract writes the model and optimizer with
``torch.distributed.checkpoint`` (which reshards on load) and the scheduler and extras as JSON.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["Checkpoints"]


class Checkpoints:
    """Checkpoints under ``directory``, the newest ``keep_last`` kept."""

    def __init__(self, directory: str | pathlib.Path, keep_last: int) -> None:
        try:
            from dist_optim.checkpoint import CheckpointManager
        except ImportError:
            self._manager = None
        else:
            self._manager = CheckpointManager(str(directory), keep_last=keep_last, async_save=False)
        self.directory, self.keep_last = pathlib.Path(directory), keep_last

    def save(self, step: int, job: Any, extra: dict[str, Any]) -> None:
        """Collective: call on every rank."""
        if self._manager is not None:
            self._manager.save(step, model=job.model, optimizer=job.opt, schedulers=[job.sched], extra=extra)
            return
        _stand_in_save(self.directory / f"step_{step:08d}", step, job, extra)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            for old in sorted(self.directory.glob("step_*"))[: -self.keep_last]:
                shutil.rmtree(old)

    def load(self, which: str, job: Any) -> tuple[int, dict[str, Any], str] | None:
        """(step, extra, path) of the checkpoint loaded into ``job``; ``None`` when "latest" finds none.
        ``which``: "latest", a path, or a step number. Collective: call on every rank."""
        if self._manager is not None:
            res = self._manager.load(int(which) if which.isdigit() else which, model=job.model, optimizer=job.opt,
                                     schedulers=[job.sched])
            return None if res is None else (res.step, res.extra, str(res.path))
        if which == "latest":
            found = sorted(self.directory.glob("step_*"))
            if not found:
                return None
            path = found[-1]
        elif which.isdigit():
            path = self.directory / f"step_{int(which):08d}"
        else:
            path = pathlib.Path(which)
        if not (path / "meta.json").exists():
            raise FileNotFoundError(f"no checkpoint at {path}")
        return _stand_in_load(path, job)


def _stand_in_save(path: pathlib.Path, step: int, job: Any, extra: dict[str, Any]) -> None:
    model_sd, optim_sd = get_state_dict(job.model, job.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        meta = {"step": step, "extra": extra, "scheduler": job.sched.state_dict()}
        meta["scheduler"].pop("lr_lambdas", None)
        (path / "meta.json").write_text(json.dumps(meta))


def _stand_in_load(path: pathlib.Path, job: Any) -> tuple[int, dict[str, Any], str]:
    model_sd, optim_sd = get_state_dict(job.model, job.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(job.model, job.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = json.loads((path / "meta.json").read_text())
    job.sched.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
    return meta["step"], meta["extra"], str(path)

"""CheckpointManager: numbered checkpoints in one folder, latest discovery, pruning, one async save at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import _ranks, _storage
from ._api import AsyncSave, LoadResult, load, write
from ._request import Objects, SaveRequest

_SAVE_KEYWORDS = frozenset({"model", "optimizer", "schedulers", "grad_scaler", "averaged_model", "extra", "force"})

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Checkpoints ``directory/step_<n>``, with ``keep_last`` pruning and ``"latest"`` discovery.

    Construct it on every rank (with ``async_save`` it creates a gloo process group of its own, a collective call).

    >>> import tempfile, torch, dist_optim
    >>> from dist_optim.checkpoint import CheckpointManager
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2)
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> manager = CheckpointManager(tempfile.mkdtemp(), keep_last=2)
    >>> for step in (10, 20, 30):
    ...     manager.save(step, model=model, optimizer=opt, extra={"batches_seen": step * 4})
    >>> [p.name for p in manager.checkpoints()]
    ['step_00000030', 'step_00000020']
    >>> result = manager.load("latest", model=model, optimizer=opt)
    >>> result.step, result.extra
    (30, {'batches_seen': 120})
    """

    def __init__(self, directory: str | Path, *, keep_last: int | None = None, async_save: bool = False,
                 process_group: Any = None) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
        self.process_group = process_group
        self._save_group = process_group
        if async_save and _ranks.distributed(process_group):
            # the upload's collectives run on a background thread: they get a group of their own
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._save_group = dist.new_group(ranks=ranks, backend="gloo")
        self._in_flight: AsyncSave | None = None

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoints, newest first (unfinished ``.partial`` folders are never listed)."""
        return [p for _, p in reversed(_storage.committed(self.directory))]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[0] if found else None

    def save(self, step: int, **objects: Any) -> None:
        """Save ``objects`` (the keywords of :func:`dist_optim.checkpoint.save`) as checkpoint ``step``. With
        ``async_save`` the previous save is waited for first, and this one runs in the background."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.wait()
        unknown = set(objects) - _SAVE_KEYWORDS
        if unknown:
            raise TypeError(f"CheckpointManager.save() got unexpected keyword(s) {sorted(unknown)}; it takes "
                            f"{sorted(_SAVE_KEYWORDS)}")
        if objects.get("model") is None:
            raise TypeError("CheckpointManager.save() needs model=")
        extra = objects.pop("extra", None)
        force = bool(objects.pop("force", False))
        group = self._save_group if self.async_save else self.process_group
        # pruning is part of rank 0's commit, before the other ranks are released
        request = SaveRequest(self.path_for(step), Objects(**objects), extra, step, self.async_save, group,
                              after_commit=self._prune, force=force)
        self._in_flight = write(request)

    def wait(self) -> None:
        """Wait for an async save in flight to be committed (re-raising its error), then prune."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.wait()

    def _prune(self) -> None:
        if self.keep_last is not None:
            _storage.prune(self.directory, self.keep_last)

    def prune(self, keep_last: int) -> list[Path]:
        """Delete all but the ``keep_last`` newest committed checkpoints now; returns the deleted paths. For a
        checkpoint that spans several managers (one per pipeline stage): build them with ``keep_last=None``, and
        prune each only once every one has committed the new step, so that a job killed between the stages' saves
        still has a step that all of them hold. Call it on one rank of the manager's group."""
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
        self.wait()
        return _storage.prune(self.directory, keep_last)

    def load(self, which: str | int | Path = "latest", **objects: Any) -> LoadResult | None:
        """Load ``"latest"`` (``None`` when there is no committed checkpoint yet), a step number, or a path."""
        self.wait()
        if which == "latest":
            # every rank must pick the same folder, even if a save is being committed meanwhile
            path = _ranks.on_rank0(self.latest, self.process_group)
            if path is None:
                return None
        elif isinstance(which, int):
            path = self.path_for(which)
        else:
            path = Path(which)
        return load(path, process_group=self.process_group, **objects)

"""What one save or load call was asked to do, as a dataclass checked once.

The public :func:`~dist_optim.checkpoint.save` / :func:`~dist_optim.checkpoint.load` keywords and the
:class:`~dist_optim.checkpoint.CheckpointManager` both build one of these; every component reads its objects from
it, so no function takes a chain of positional arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._names import Remap

__all__: list[str] = []


def _as_schedulers(schedulers: Any) -> list[Any]:
    if schedulers is None:
        return []
    return [schedulers] if hasattr(schedulers, "state_dict") else list(schedulers)


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` names are stored: DDP's ``.module`` (other wrappers keep their names and
    lose their prefixes in :func:`~._names.canonical_name`)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@dataclass
class Objects:
    """The training objects a checkpoint holds; ``None`` (or no schedulers) means "not this component"."""

    model: nn.Module  # as trained: plain, FSDP2-sharded or DDP-wrapped
    optimizer: torch.optim.Optimizer | None = None
    schedulers: list[Any] = field(default_factory=list)  # LR schedulers, in a fixed order
    grad_scaler: Any = None  # torch.amp.GradScaler
    averaged_model: nn.Module | None = None  # EMA/SWA AveragedModel

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(self.model).__name__}")
        self.schedulers = _as_schedulers(self.schedulers)

    @property
    def module(self) -> nn.Module:
        return unwrap(self.model)


@dataclass
class SaveRequest:
    path: Path  # the checkpoint folder to create
    objects: Objects
    extra: dict[str, Any] = field(default_factory=dict)  # the user's plain data, stored as JSON
    step: int | None = None  # the training step counter, given back by load
    async_save: bool = False  # write in the background after copying the state
    process_group: Any = None  # the ranks taking part (None: the default group)
    after_commit: Callable[[], Any] | None = None  # run by rank 0 right after the checkpoint became visible
    force: bool = False  # save an optimizer whose in-backward step is incomplete (a backward raised mid-step)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.extra = {} if self.extra is None else self.extra


@dataclass
class LoadRequest:
    path: Path  # the checkpoint folder to read
    objects: Objects
    remap: Remap = field(default_factory=Remap)  # name changes between the saved and the current model
    strict: bool = True  # a name missing on either side is an error (else: kept fresh / ignored)
    restore_rng: bool = True  # set this rank's RNG states from the checkpoint
    process_group: Any = None

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.remap = Remap() if self.remap is None else self.remap

"""Sharded checkpoints with ``torch.distributed.checkpoint``: save on any ranks, resume on any others.

A checkpoint holds the model, the optimizer state of every parameter keyed by its name (wrapper prefixes removed by
:func:`canonical_name`), LR schedulers, the grad scaler, an EMA/SWA model, each rank's RNG states, the step counter
and your ``extra`` data. Tensors go through DCP (each rank writes its own shards); everything else is JSON, so
loading executes no code from the checkpoint (see docs/checkpointing.md for what DCP's own metadata reading
trusts, and how we restrict it).

- :func:`save` / :func:`load`: one checkpoint folder, written atomically.
- :class:`CheckpointManager`: numbered checkpoints, ``"latest"``, ``keep_last``, async saves.
- :class:`Remap`: load into a model whose names changed (rename, duplicate, fresh, ignore).
"""

from ._api import AsyncSave, LoadResult, load, save
from ._manager import CheckpointManager
from ._names import Remap, canonical_name
from ._storage import CheckpointError

__all__ = ["save", "load", "CheckpointManager", "Remap", "LoadResult", "AsyncSave", "CheckpointError",
           "canonical_name"]

"""The training text and its batches: the Python stdlib's own ``.py`` sources as bytes (vocabulary 256).

No download: the corpus is the stdlib directory of the running interpreter, read in a fixed sorted order and capped,
so every run on the same installation sees the same bytes. Batches are a function of (seed, step) only: each rank
takes its contiguous slice of the same global batch, so the global batch is the same whatever the world size, and a
resumed run continues with exactly the batches it would have had.
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch

from .runtime import LaunchError

__all__ = ["VOCAB_SIZE", "Corpus"]

VOCAB_SIZE = 256
_EXCLUDED = ("test", "idlelib", "site-packages", "__pycache__")  # large, or not part of every installation


def _py_files(directory: pathlib.Path):
    """``.py`` files of ``directory`` in sorted order, then its subdirectories' (sorted), depth first."""
    entries = sorted(directory.iterdir(), key=lambda p: p.name)
    yield from (p for p in entries if p.is_file() and p.suffix == ".py")
    for sub in entries:
        if sub.is_dir() and sub.name not in _EXCLUDED:
            yield from _py_files(sub)


def stdlib_sources(cap_bytes: int) -> bytes:
    """The stdlib's ``.py`` files concatenated in a fixed order (top level first), stopping at ``cap_bytes``."""
    parts, size = [], 0
    for path in _py_files(pathlib.Path(sysconfig.get_paths()["stdlib"])):
        parts.append(path.read_bytes()[: cap_bytes - size])
        size += len(parts[-1])
        if size >= cap_bytes:
            break
    return b"".join(parts)


class Corpus:
    """Byte tokens of the stdlib sources, and the deterministic batches drawn from them.

    Args:
        cap_mb: MiB of text at most.
        block_size: tokens per sequence.
        seed: with the step number, decides every batch.
    """

    def __init__(self, cap_mb: float, block_size: int, seed: int) -> None:
        text = stdlib_sources(int(cap_mb * 2**20))
        if len(text) <= block_size + 1:
            raise LaunchError(f"block_size + 2 = {block_size + 2} bytes must fit in the corpus, which has {len(text)} "
                              f"(--corpus-mb {cap_mb}): lower --block-size or raise --corpus-mb")
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.block_size = block_size
        self.seed = seed

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, each ``(batch_size, block_size)`` int64, for optimizer step ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (batch_size,), generator=g)
        rows = torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

    def micro_batches(self, step: int, batch_size: int, rank: int, world: int, accumulation: int):
        """This rank's micro-batches of step ``step``: its slice of the global batch, cut into ``accumulation``
        equal parts. The global batch must divide evenly (checked by the caller)."""
        x, y = self.global_batch(step, batch_size)
        per_rank = batch_size // world
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        return list(zip(x.chunk(accumulation), y.chunk(accumulation)))

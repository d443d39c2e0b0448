"""Which layouts a blockwise-quantised optimizer state (torchao's) loads into exactly, and from which saved pieces.

A state is kept in pieces, each a contiguous run of the flattened parameter: the whole parameter (one process,
DDP) or one FSDP2 ``Shard(0)`` shard per rank. torchao quantises a piece (a local tensor) when it has at least
4096 elements and a multiple of its block size, in blocks that start at the piece's first element, and keeps it
plain otherwise. A piece of another layout is then the saved bytes, cut and joined, exactly when torchao would
treat it as the saved elements it covers were treated: quantised, from quantised pieces whose blocks it starts on
(its blocks are then saved blocks), or plain, from plain pieces. Anything else could only be re-quantised (or
de-quantised), which changes the values: refused.

Pure arithmetic on shapes (no tensors, no ranks): every rank decides alike, for every rank's piece.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine._inputs import is_dtensor

__all__: list[str] = []

# torchao 0.11's ``_AdamBase._new_buffer``: a local tensor of at least this many elements and a multiple of the block
# size is quantised, any other is a plain tensor (tests/test_checkpoint_low_bit.py pins this against torchao's own)
MIN_ELEMENTS = 4096
# The optimizer-state keys torchao's Adam classes create with ``_new_buffer``
BUFFER_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
# The world sizes a refusal checks when it says where a checkpoint would load: 1 to this, or twice the saving one's
CHECKED_WORLDS = 8


@dataclass(frozen=True)
class Piece:
    """Saved elements ``[start, stop)`` of the flattened parameter, as one rank (or the whole-parameter save,
    ``rank=None``) stored them."""

    start: int
    stop: int
    quantised: bool
    rank: int | None = None
    label: str = ""  # what it is, where the rank does not say

    def __str__(self) -> str:
        what = "quantised" if self.quantised else "plain"
        if self.label:
            return f"{self.label} ({what})"
        if self.rank is None:
            return f"the saved state of the whole parameter ({self.stop} elements, {what})"
        return f"saved rank {self.rank}'s shard, elements [{self.start}, {self.stop}) ({what})"


@dataclass(frozen=True)
class Layout:
    """How one state was saved: the parameter's shape, its pieces in order, and the block size of the quantised
    ones (``None`` if none is)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    block: int | None


def quantises(n: int, block: int | None) -> bool:
    """Whether torchao makes a local tensor of ``n`` elements a quantised state (with blocks of ``block``)."""
    return block is not None and n >= MIN_ELEMENTS and n % block == 0


def _treatment(n: int, block: int | None) -> str:
    if quantises(n, block):
        return f"quantises ({n} elements: at least {MIN_ELEMENTS}, a multiple of its block size {block})"
    why = f"fewer than {MIN_ELEMENTS}" if n < MIN_ELEMENTS else f"not a multiple of its block size {block}"
    return f"keeps plain ({n} elements: {why})"


def shard_ranges(shape: tuple[int, ...], world: int) -> list[tuple[int, int]]:
    """Each rank's flat elements ``[start, stop)`` under ``Shard(0)`` on ``world`` ranks: ``torch.chunk`` along
    dim 0, as FSDP2 and DTensor cut (trailing ranks may be empty); ``world=1``: the whole parameter."""
    numel = math.prod(shape)
    if world == 1 or not shape:
        return [(0, numel)] + [(numel, numel)] * (world - 1)
    rows, row = shape[0], (numel // shape[0] if shape[0] else 0)
    size = -(-rows // world)
    return [(min(c * size, rows) * row, min((c + 1) * size, rows) * row) for c in range(world)]


def target_of(p: torch.Tensor) -> tuple[int, int] | None:
    """``(world, coordinate)`` of the piece ``p`` holds: ``(1, 0)`` for a whole parameter, FSDP2's ``Shard(0)`` on a
    1-D mesh; ``None`` for any other layout (tensor parallel, a 2-D mesh), which this module does not cut."""
    if not is_dtensor(p):
        return 1, 0
    from torch.distributed.tensor import Shard

    placement = p.placements[0] if len(p.placements) == 1 else None
    # _StridedShard (FSDP2 over TP) is a Shard too, cut otherwise: the exact type only
    if p.device_mesh.ndim != 1 or type(placement) is not Shard or placement.dim != 0:
        return None
    world, coordinate = p.device_mesh.size(), p.device_mesh.get_local_rank()
    start, stop = shard_ranges(tuple(p.shape), world)[coordinate]
    local = p.to_local()
    if local.numel() != stop - start or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        return None  # cut some other way than torch.chunk: not this module's arithmetic
    return world, coordinate


def where(world: int, coordinate: int) -> str:
    return "the whole parameter" if world == 1 else f"rank {coordinate}'s shard under FSDP2 on {world} ranks"


def fill(layout: Layout, start: int, stop: int, block: int | None) -> list[tuple[Piece, int, int]] | str:
    """The saved pieces that make up elements ``[start, stop)`` for an optimizer that quantises with ``block``, as
    ``(piece, first, last)`` element ranges within each piece; or why they cannot without re-quantising."""
    n = stop - start
    quantised = quantises(n, block)
    over = [p for p in layout.pieces if p.start < stop and p.stop > start]
    span = f"elements [{start}, {stop})"
    wrong = next((p for p in over if p.quantised != quantised), None)
    if wrong is not None:
        return (f"torchao {_treatment(n, block)} {span}, but they hold {wrong}: filling them would "
                + ("de-quantise" if wrong.quantised else "quantise") + " the saved values")
    if quantised and layout.block != block:
        return (f"the saved state is quantised in blocks of {layout.block} elements and this optimizer quantises in "
                f"blocks of {block}: build it with block_size={layout.block}")
    if quantised and (start - over[0].start) % block:
        return (f"torchao {_treatment(n, block)} {span} in blocks from element {start}, which falls inside a block of "
                f"{over[0]}, whose blocks of {block} start at element {over[0].start}")
    return [(p, max(start, p.start) - p.start, min(stop, p.stop) - p.start) for p in over]


def misfit(layout: Layout, world: int, block: int | None) -> str | None:
    """Why some rank's piece of ``world`` ranks (1: the whole parameter) cannot be filled exactly, or ``None``."""
    for c, (start, stop) in enumerate(shard_ranges(layout.shape, world)):
        found = fill(layout, start, stop, block)
        if isinstance(found, str):
            return f"{where(world, c)}: {found}"
    return None


def loadable(layouts: list[tuple[Layout, int | None]], saved_world: int) -> str:
    """In words, the layouts where every one of ``layouts`` (each with the block size it is loaded with) loads
    exactly: unsharded, and FSDP2 world sizes among the first few."""
    up_to = max(CHECKED_WORLDS, 2 * saved_world)
    fits = [w for w in range(1, up_to + 1) if all(misfit(lay, w, b) is None for lay, b in layouts)]
    sharded = [w for w in fits if w > 1]
    places = (["unsharded (one process, or DDP on any number of ranks)"] if 1 in fits else []) + (
        [f"under FSDP2 (Shard(0), a 1-D mesh) on {', '.join(map(str, sharded))} ranks"] if sharded else [])
    if not places:
        return f"on none of world sizes 1 to {up_to} (unsharded or FSDP2): resume on the saving job's layout"
    return f"{' and '.join(places)} (world sizes 1 to {up_to} checked)"

"""Optimizer states that are tensor subclasses (torchao's ``OptimState8bit``, ``OptimState4bit``,
``OptimStateFp8``): stored as their inner plain tensors, rebuilt as the same class on load.

A quantised state is a wrapper whose data lives in inner tensors (codes, block scales, a lookup table) and a few
plain attributes (signedness, the original shape). DCP stores plain tensors and DTensors only, so each state is
taken apart with the subclass's own ``__tensor_flatten__`` (inner tensors under ``optim_q/<name>/<key>/...``, the
attributes and the class's name as JSON) and put back together with ``__tensor_unflatten__``: the codes and
scales are the saved bytes, never re-quantised.

Two layouts on save:

- **replicated** (one process, DDP): the state covers the whole parameter and is the same on every rank; it is
  written once.
- **sharded** (FSDP2: a DTensor whose local tensor is the subclass): each rank quantised its own shard, in blocks
  that start at the shard's first element, and stores its pieces under its rank, with its place on the mesh. A
  rank whose shard torchao kept plain (fewer than 4096 elements, or not a multiple of the block size) stores it
  plain beside them.

On load, torchao's states (``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``) are cut and joined
(:mod:`._reshard`): under FSDP2's ``Shard(0)`` a shard is a contiguous run of the flattened parameter, so where
the saved and the new pieces start on block boundaries, the new piece's codes and scales are slices of the saved
ones, joined in order: between one process, DDP and FSDP2 on any number of ranks, bitwise, never re-quantised. A
piece loads only as what torchao's own optimizer would hold there (quantised when it has at least 4096 elements and
a multiple of the block size, else plain); a piece that could then only be re-quantised or de-quantised is refused,
with its sizes and the world sizes that would work, before anything is loaded (``_optim_state`` checks torchao's
states saved plain the same way). Any other subclass, placement or mesh loads on the saving job's layout only.

The class is looked up among modules already imported (the optimizer's package imports it), never imported from a
name in a checkpoint, and must be a tensor subclass with ``__tensor_unflatten__``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine._inputs import is_dtensor
from . import _reshard
from ._storage import CheckpointError

__all__: list[str] = []

PREFIX = "optim_q"
# The key of dist_optim.json's optimizer section that describes the subclass states: {name: {state key: entry}}.
PLAIN_KEY = "subclass_states"
# The inner name of a rank's plain shard of a sharded state that other ranks quantised.
PLAIN_SHARD = "plain"


def is_subclass_state(v: Any) -> bool:
    """A tensor of a class other than ``Tensor``/``Parameter``/``DTensor`` (a wrapper such as torchao's states)."""
    return isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, nn.Parameter) and not is_dtensor(v)


def local_subclass(v: Any) -> bool:
    """A DTensor whose local shard is a subclass state (torchao's states under FSDP2)."""
    return is_dtensor(v) and is_subclass_state(v.to_local())


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def flatten(v: torch.Tensor, where: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(description, {inner path: plain tensor})`` of a subclass state, recursively for nested subclasses."""
    if not hasattr(type(v), "__tensor_flatten__") or not hasattr(type(v), "__tensor_unflatten__"):
        raise NotImplementedError(
            f"optimizer state {where} is a {type(v).__name__}, a tensor subclass without __tensor_flatten__/"
            "__tensor_unflatten__: dist_optim.checkpoint cannot take it apart into plain tensors and would load it "
            "back as a plain tensor of its shape, and the optimizer would step differently. Save this optimizer "
            "with torch.save(optimizer.state_dict())"
        )
    names, attrs = v.__tensor_flatten__()
    inner: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for n in names:
        t = getattr(v, n)
        if is_subclass_state(t):
            inner[n], nested = flatten(t, f"{where}.{n}")
            tensors.update({f"{n}/{k}": x for k, x in nested.items()})
        else:
            inner[n] = None
            tensors[n] = t.detach()
    desc = {"class": _qualname(type(v)), "attrs": list(attrs), "inner": inner, "shape": list(v.shape)}
    if isinstance(getattr(v, "block_size", None), int):
        desc["block_size"] = v.block_size  # for the messages only: the codes and scales define the blocks
    return desc, tensors


def inner_paths(desc: dict[str, Any]) -> list[str]:
    out = []
    for n, sub in desc["inner"].items():
        out.extend([f"{n}/{p}" for p in inner_paths(sub)] if sub is not None else [n])
    return out


def resolve(qualname: str, where: str) -> type:
    """The class named in a checkpoint, from a module already imported: loading never imports code."""
    module, _, name = qualname.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and hasattr(cls, "__tensor_unflatten__")):
        raise CheckpointError(
            f"{where}: the saved state is a {qualname}, a tensor subclass that "
            + ("is not a tensor subclass with __tensor_unflatten__" if module in sys.modules else
               f"comes from {module}, which is not imported")
            + ": import the package of the optimizer the checkpoint was written with (its state class is looked "
            "up among modules already imported, never imported from a checkpoint) before loading"
        )
    return cls


def unflatten(desc: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    cls = resolve(desc["class"], where)
    inner = {}
    for n, sub in desc["inner"].items():
        if sub is None:
            inner[n] = tensors[n]
        else:
            inner[n] = unflatten(sub, {k[len(n) + 1:]: t for k, t in tensors.items() if k.startswith(f"{n}/")}, where)
    out = cls.__tensor_unflatten__(inner, list(desc["attrs"]), torch.Size(desc["shape"]), None)
    if type(out) is not cls or list(out.shape) != list(desc["shape"]):
        raise CheckpointError(f"{where}: {desc['class']}.__tensor_unflatten__ did not rebuild the saved state "
                              f"(got a {type(out).__name__} of shape {tuple(out.shape)})")
    return out


# -- save ------------------------------------------------------------------------------------------------------
def _coordinate(v: torch.Tensor) -> list[int]:
    """This rank's place on the state's device mesh: the order of the shards."""
    return list(v.device_mesh.get_coordinate() or [])


def collect(name: str, key: str, v: torch.Tensor, rank: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """Add a subclass state's inner tensors to ``tensors`` (DCP keys) and return this rank's description of it."""
    where = f"{key!r} of {name}"
    if local_subclass(v):
        desc, inner = flatten(v.to_local(), where)
        base = f"{PREFIX}/{name}/{key}/rank{rank}"
        desc.update(layout="sharded", global_shape=list(v.shape), mesh=list(v.device_mesh.shape),
                    placements=repr(tuple(v.placements)), coordinate=_coordinate(v))
    else:
        desc, inner = flatten(v, where)
        base = f"{PREFIX}/{name}/{key}"
        desc["layout"] = "replicated"
    tensors.update({f"{base}/{p}": t for p, t in inner.items()})
    return desc


def collect_plain_shard(name: str, key: str, v: torch.Tensor, rank: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """Store this rank's plain shard of a state other ranks quantised (torchao quantises a shard of at least 4096
    elements, a multiple of its block size: uneven FSDP2 shards can differ) and return its description."""
    if not is_dtensor(v):
        raise NotImplementedError(f"optimizer state {key!r} of {name} is quantised under FSDP2 on other ranks and a "
                                  f"{type(v).__name__} here: dist_optim.checkpoint cannot store such a mix")
    tensors[f"{PREFIX}/{name}/{key}/rank{rank}/{PLAIN_SHARD}"] = v.to_local()
    return {"plain": True, "shape": list(v.to_local().shape), "coordinate": _coordinate(v)}


def merge(per_rank: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """One entry per state from every rank's descriptions: a sharded state keeps each rank's (``None`` for a
    rank whose shard is plain, until :func:`merge_plain_shards` fills it in)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rank, states in enumerate(per_rank):
        for name, keys in states.items():
            for key, desc in keys.items():
                if desc["layout"] == "replicated":
                    out.setdefault(name, {}).setdefault(key, desc)
                    continue
                entry = out.setdefault(name, {}).setdefault(key, {
                    "layout": "sharded", "world_size": len(per_rank), "class": desc["class"],
                    "global_shape": desc["global_shape"], "mesh": desc["mesh"], "placements": desc["placements"],
                    "ranks": [None] * len(per_rank)})
                entry["ranks"][rank] = {k: v for k, v in desc.items()
                                        if k not in ("layout", "global_shape", "mesh", "placements")}
    return out


def has_plain_shards(merged: dict[str, dict[str, dict[str, Any]]]) -> bool:
    """Whether some sharded state is plain on some rank (the same answer on every rank: ``merged`` is)."""
    return any(None in e.get("ranks", ()) for keys in merged.values() for e in keys.values())


def merge_plain_shards(merged: dict[str, dict[str, dict[str, Any]]],
                       per_rank: list[dict[str, dict[str, dict[str, Any]]]]) -> None:
    """Put each rank's plain-shard descriptions (:func:`collect_plain_shard`) into ``merged``."""
    for rank, states in enumerate(per_rank):
        for name, keys in states.items():
            for key, desc in keys.items():
                merged[name][key]["ranks"][rank] = desc


# -- load ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packing:
    """How a class from torchao lays its inner tensors over the elements, which lets a state be cut and joined
    at block boundaries: ``codes`` hold ``per_code`` elements an entry, ``scale`` one value a block, the
    ``shared`` tensors (the lookup table) are the same in every piece."""

    per_code: int  # elements per entry of ``codes`` (4-bit: two codes a byte)
    shaped_codes: bool  # ``codes`` has the piece's shape (else it is flat)
    shape_attr: int | None  # where among the flattened attributes the piece's shape is (the 4-bit class keeps it)
    shared: tuple[str, ...]


# torchao 0.11's quantised states (tests/test_checkpoint_low_bit.py checks each against torchao's own quantiser)
PACKINGS = {
    "torchao.optim.subclass_8bit.OptimState8bit": Packing(1, True, None, ("qmap",)),
    "torchao.optim.subclass_4bit.OptimState4bit": Packing(2, False, 1, ("qmap",)),
    "torchao.optim.subclass_fp8.OptimStateFp8": Packing(1, True, None, ()),
}


class Misfit(CheckpointError):
    """A state the target layout cannot hold without re-quantising: collected, then refused together."""


def _shard0() -> str:
    from torch.distributed.tensor import Shard

    return repr((Shard(0),))


def _packed(desc: dict[str, Any], pack: Packing) -> bool:
    return set(desc.get("inner") or {}) == {"codes", "scale", *pack.shared} and all(
        desc["inner"][n] is None for n in desc["inner"]) and isinstance(desc.get("block_size"), int)


def layout(entry: dict[str, Any], source: str, key: str, src: Any) -> _reshard.Layout | None:
    """Where the pieces of a saved torchao state lie, or ``None`` where this module cannot cut it (another class,
    placement or mesh): such a state loads on the saving job's layout only."""
    pack = PACKINGS.get(entry["class"])
    if pack is None:
        return None
    if entry["layout"] == "replicated":
        if not _packed(entry, pack):
            return None
        shape = tuple(entry["shape"])
        return _reshard.Layout(shape, (_reshard.Piece(0, math.prod(shape), True),), entry["block_size"])
    world = entry["world_size"]
    if entry["mesh"] != [world] or entry["placements"] != _shard0():
        return None
    shape = tuple(entry["global_shape"])
    by_coordinate: dict[int, tuple[int, int, bool]] = {}  # coordinate -> (rank, elements, quantised)
    blocks = set()
    for rank, d in enumerate(entry["ranks"]):
        if d is None:  # written before plain shards were described: its shape from the file, its place its rank
            md = src.tensor_meta(f"{PREFIX}/{source}/{key}/rank{rank}/{PLAIN_SHARD}")
            if md is None:
                return None
            d = {"plain": True, "shape": list(md.size), "coordinate": [rank]}
        if not d.get("plain"):
            if not _packed(d, pack):
                return None
            blocks.add(d["block_size"])
        coordinate = d.get("coordinate", [rank])
        by_coordinate[coordinate[0] if len(coordinate) == 1 else -1] = (rank, math.prod(d["shape"]),
                                                                        not d.get("plain"))
    if sorted(by_coordinate) != list(range(world)) or len(blocks) != 1:
        return None
    pieces, start = [], 0
    for c, (want_start, want_stop) in enumerate(_reshard.shard_ranges(shape, world)):
        rank, n, quantised = by_coordinate[c]
        if (start, start + n) != (want_start, want_stop):
            return None
        pieces.append(_reshard.Piece(start, start + n, quantised, rank))
        start += n
    return _reshard.Layout(shape, tuple(pieces), blocks.pop())


def join(desc: dict[str, Any], parts: list[tuple[dict[str, torch.Tensor], int, int]], block: int,
         shape: tuple[int, ...], where: str) -> torch.Tensor:
    """The quantised state of a piece of ``shape`` whose elements are ``parts``' ``[first, last)`` in turn (each
    part the inner tensors of a saved piece, quantised in blocks of ``block``): codes and scales cut at block
    boundaries and joined, the saved bytes unchanged."""
    pack = PACKINGS[desc["class"]]

    def cut(t: torch.Tensor, first: int, last: int) -> torch.Tensor:
        flat = t.reshape(-1)
        return flat if (first, last) == (0, flat.numel()) else flat[first:last].clone()  # no view of a bigger read

    def joined(xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0] if len(xs) == 1 else torch.cat(xs)

    codes = joined([cut(t["codes"], a // pack.per_code, b // pack.per_code) for t, a, b in parts])
    inner = {"codes": codes.view(shape) if pack.shaped_codes else codes,
             "scale": joined([cut(t["scale"], a // block, b // block) for t, a, b in parts]),
             **{n: parts[0][0][n] for n in pack.shared}}
    attrs = list(desc["attrs"])
    if pack.shape_attr is not None:
        attrs[pack.shape_attr] = torch.Size(shape)
    out = unflatten({**desc, "attrs": attrs, "shape": list(shape)}, inner, where)
    if out.block_size != block:
        raise CheckpointError(f"{where}: the joined {desc['class']} has blocks of {out.block_size} elements, the saved "
                              f"one {block}")
    return out


def _wrap(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _saved_how(entry: dict[str, Any]) -> str:
    if entry["layout"] == "replicated":
        return "saved whole by one process or DDP"
    return f"saved in per-rank shards by {entry['world_size']} rank(s), placements {entry['placements']}"


def plan(entry: dict[str, Any], source: str, key: str, target: str, p: torch.Tensor, rank: int, world: int,
         src: Any, block: int | None) -> Callable[[], torch.Tensor]:
    """Register the reads of one saved subclass state for parameter ``p`` and return what rebuilds it after the
    read. ``block``: the block size the loading optimizer quantises with (``None``: unknown, the saved one).
    Raises :class:`Misfit` for a torchao state this layout cannot hold exactly, ``CheckpointError`` for any other
    state saved on another layout; both before anything is modified."""
    where = f"{src.folder}: optimizer state {key!r} of {target}"
    resolve(entry["class"], where)
    lay = layout(entry, source, key, src)
    here = _reshard.target_of(p)
    if lay is not None and here is not None:
        return _plan_cut(entry, lay, source, key, target, p, here, src, block if block is not None else lay.block)
    return _plan_same_layout(entry, source, key, target, p, rank, world, src, where)


def _plan_cut(entry: dict[str, Any], lay: _reshard.Layout, source: str, key: str, target: str, p: torch.Tensor,
              here: tuple[int, int], src: Any, block: int) -> Callable[[], torch.Tensor]:
    """A torchao state into the whole parameter or an FSDP2 ``Shard(0)`` shard: the saved pieces it covers, cut
    at block boundaries and joined. Every rank's piece is checked, so that all ranks refuse together."""
    pack = PACKINGS[entry["class"]]
    cls_name = entry["class"].rpartition(".")[2]
    world, coordinate = here
    bad = _reshard.misfit(lay, world, block)
    if bad is not None:
        raise Misfit(f"{key!r} of {target} ({cls_name}, {_saved_how(entry)}): {bad}")
    start, stop = _reshard.shard_ranges(lay.shape, world)[coordinate]
    found = _reshard.fill(lay, start, stop, block)
    assert not isinstance(found, str), found  # misfit() checked every rank's piece
    quantised = _reshard.quantises(stop - start, block)
    descs = [entry] if entry["layout"] == "replicated" else [entry["ranks"][piece.rank] for piece, _, _ in found]

    def kept(d: dict[str, Any]) -> list[Any]:  # the attributes but the piece's shape (signedness)
        return [a for i, a in enumerate(d["attrs"]) if i != pack.shape_attr]

    if quantised and any(kept(d) != kept(descs[0]) for d in descs):
        raise Misfit(f"{key!r} of {target} ({cls_name}, {_saved_how(entry)}): the saved pieces it would join have "
                     f"different attributes ({[d['attrs'] for d in descs]})")
    device = p.to_local().device if is_dtensor(p) else p.device
    label = f"{cls_name} of {target}"
    parts: list[tuple[dict[str, torch.Tensor], int, int]] = []
    for k, (piece, first, last) in enumerate(found):
        base = f"{PREFIX}/{source}/{key}" + (f"/rank{piece.rank}" if piece.rank is not None else "")
        names = ["codes", "scale", *(pack.shared if k == 0 else ())] if quantised else [PLAIN_SHARD]
        parts.append((_read(src, base, names, device, label), first, last))
    shape = tuple(p.to_local().shape) if is_dtensor(p) else tuple(p.shape)
    where = f"{src.folder}: optimizer state {key!r} of {target}"

    def build() -> torch.Tensor:
        if quantised:
            return _wrap(join(descs[0], parts, block, shape, where), p)
        xs = [t[PLAIN_SHARD].reshape(-1)[a:b] for t, a, b in parts]
        if len(xs) == 1 and xs[0].numel() == parts[0][0][PLAIN_SHARD].numel():
            local = xs[0].view(shape)  # a saved shard as it is
        else:  # copies: no view keeps a bigger read alive
            local = torch.cat(xs).view(shape) if xs else torch.zeros(shape, dtype=p.dtype, device=device)
        return _wrap(local, p)

    return build


def _read(src: Any, base: str, names: list[str], device: torch.device, label: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        md = src.tensor_meta(f"{base}/{name}")
        if md is None:
            raise src.error(f"{base}/{name} ({label}'s {name}) is missing")
        out[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
        src.read_into(f"{base}/{name}", out[name], f"{label}'s {name}")
    return out


def _plan_same_layout(entry: dict[str, Any], source: str, key: str, target: str, p: torch.Tensor, rank: int,
                      world: int, src: Any, where: str) -> Callable[[], torch.Tensor]:
    """Any other subclass state: whole into whole, or each rank's shard back on the saving job's layout."""
    cls_name = entry["class"].rpartition(".")[2]
    if entry["layout"] == "replicated":
        if is_dtensor(p):
            raise CheckpointError(
                f"{where} is a {cls_name} of the whole parameter (saved by one process or DDP), and the parameter "
                f"is now sharded ({type(p).__name__} with placements {tuple(p.placements)}) in a way "
                "dist_optim.checkpoint does not cut quantised states (it cuts torchao's states for FSDP2's Shard(0) "
                "on a 1-D mesh): each shard would need its own quantisation blocks, which only re-quantising could "
                "give, and that changes the values. Resume with the saving job's layout"
            )
        desc, base = entry, f"{PREFIX}/{source}/{key}"
        shape = tuple(p.shape)
    else:
        saved_world = entry["world_size"]
        here = (f"{world} rank(s)" + (f", placements {tuple(p.placements)}" if is_dtensor(p) else ", unsharded"))
        saved = f"{saved_world} rank(s), placements {entry['placements']}"
        same = (is_dtensor(p) and saved_world == world and list(p.device_mesh.shape) == entry["mesh"]
                and repr(tuple(p.placements)) == entry["placements"])
        if same:
            desc = entry["ranks"][rank]  # None or {"plain": True, ...}: this rank's shard was plain
            desc = None if desc is None or desc.get("plain") else desc
            shape = tuple(p.to_local().shape)
            md = src.tensor_meta(f"{PREFIX}/{source}/{key}/rank{rank}/{PLAIN_SHARD}") if desc is None else None
            same = list(shape) == (desc["shape"] if desc is not None else list(md.size) if md is not None else None)
        if not same:
            blocks = next((r["block_size"] for r in entry["ranks"] if r and "block_size" in r), None)
            raise CheckpointError(
                f"{where} is a {cls_name} saved in per-rank shards by {saved} (world size {saved_world}); this "
                f"load has {here} (world size {world}). Each rank quantised its own shard in blocks"
                + (f" of {blocks} elements" if blocks else "") + " starting at the shard's first element, and "
                "dist_optim.checkpoint cuts and joins such shards only for torchao's states under FSDP2's Shard(0) "
                "on a 1-D mesh; here the state could only be re-quantised, which changes its values. Resume on the "
                "saving job's layout, or load the weights only (load(path, model=model)) and start the optimizer "
                "afresh"
            )
        base = f"{PREFIX}/{source}/{key}/rank{rank}"
        if desc is None:  # a plain shard: read as it is
            desc = {"shape": list(shape), "plain": True}
    if list(shape) != list(desc["shape"]):
        raise CheckpointError(f"{where}: the saved {cls_name} has shape {tuple(desc['shape'])}, the parameter "
                              f"{tuple(shape)}")
    device = p.to_local().device if is_dtensor(p) else p.device
    inner = _read(src, base, [PLAIN_SHARD] if desc.get("plain") else inner_paths(desc), device,
                  f"{cls_name} of {target}")

    def build() -> torch.Tensor:
        return _wrap(inner[PLAIN_SHARD] if desc.get("plain") else unflatten(desc, inner, where), p)

    return build

"""Optimizer states that are tensor subclasses (torchao's ``OptimState8bit``, ``OptimState4bit``,
``OptimStateFp8``): stored as their inner plain tensors, rebuilt as the same class on load.

A quantised state is a wrapper whose data lives in inner tensors (codes, block scales, a lookup table) and a few
plain attributes (signedness, the original shape). DCP stores plain tensors and DTensors only, so each state is
taken apart with the subclass's own ``__tensor_flatten__`` (inner tensors under ``optim_q/<name>/<key>/...``, the
attributes and the class's name as JSON) and put back together with ``__tensor_unflatten__``: the codes and
scales are the saved bytes, never re-quantised.

Two layouts:

- **replicated** (one process, DDP): the state covers the whole parameter and is the same on every rank; it is
  written once and loads on any number of ranks that hold the whole parameter.
- **sharded** (FSDP2: a DTensor whose local tensor is the subclass): each rank quantised its own shard in blocks
  that start at the shard's first element, so the blocks depend on the world size. Each rank's pieces are stored
  under its rank; they load on the same world size, mesh and placements only. On another world size the blocks
  would move and the state could only be re-quantised, which changes its values: refused, naming both sizes.

The class is looked up among modules already imported (the optimizer's package imports it), never imported from a
name in a checkpoint, and must be a tensor subclass with ``__tensor_unflatten__``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._inputs import is_dtensor
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
def collect(name: str, key: str, v: torch.Tensor, rank: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """Add a subclass state's inner tensors to ``tensors`` (DCP keys) and return this rank's description of it."""
    where = f"{key!r} of {name}"
    if local_subclass(v):
        desc, inner = flatten(v.to_local(), where)
        base = f"{PREFIX}/{name}/{key}/rank{rank}"
        desc.update(layout="sharded", global_shape=list(v.shape), mesh=list(v.device_mesh.shape),
                    placements=repr(tuple(v.placements)))
    else:
        desc, inner = flatten(v, where)
        base = f"{PREFIX}/{name}/{key}"
        desc["layout"] = "replicated"
    tensors.update({f"{base}/{p}": t for p, t in inner.items()})
    return desc


def collect_plain_shard(name: str, key: str, v: torch.Tensor, rank: int, tensors: dict[str, Any]) -> None:
    """This rank's plain shard of a state other ranks quantised (torchao quantises a shard of at least 4096
    elements, a multiple of its block size: uneven FSDP2 shards can differ)."""
    if not is_dtensor(v):
        raise NotImplementedError(f"optimizer state {key!r} of {name} is quantised under FSDP2 on other ranks and a "
                                  f"{type(v).__name__} here: dist_optim.checkpoint cannot store such a mix")
    tensors[f"{PREFIX}/{name}/{key}/rank{rank}/{PLAIN_SHARD}"] = v.to_local()


def merge(per_rank: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """One entry per state from every rank's descriptions: a sharded state keeps each rank's."""
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


# -- load ------------------------------------------------------------------------------------------------------
def plan(entry: dict[str, Any], source: str, key: str, target: str, p: torch.Tensor, rank: int, world: int,
         src: Any) -> Callable[[], torch.Tensor]:
    """Register the reads of one saved subclass state for parameter ``p`` and return what rebuilds it after the
    read. Refuses (``CheckpointError``, before anything is modified) a layout that cannot be loaded exactly."""
    where = f"{src.folder}: optimizer state {key!r} of {target}"
    cls_name = entry["class"].rpartition(".")[2]
    resolve(entry["class"], where)
    if entry["layout"] == "replicated":
        if is_dtensor(p):
            raise CheckpointError(
                f"{where} is a {cls_name} of the whole parameter (saved by one process or DDP), and the parameter "
                f"is now sharded ({type(p).__name__} with placements {tuple(p.placements)}): each shard would need "
                "its own quantisation blocks, which only re-quantising could give, and that changes the values. "
                "Resume with the saving job's layout (one process or DDP, any number of ranks)"
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
            desc = entry["ranks"][rank]  # None: this rank's shard was plain (too small to quantise)
            shape = tuple(p.to_local().shape)
            md = src.tensor_meta(f"{PREFIX}/{source}/{key}/rank{rank}/{PLAIN_SHARD}") if desc is None else None
            same = list(shape) == (desc["shape"] if desc is not None else list(md.size) if md is not None else None)
        if not same:
            blocks = next((r["block_size"] for r in entry["ranks"] if r and "block_size" in r), None)
            raise CheckpointError(
                f"{where} is a {cls_name} saved in per-rank shards by {saved} (world size {saved_world}); this "
                f"load has {here} (world size {world}). Each rank quantised its own shard in blocks"
                + (f" of {blocks} elements" if blocks else "") + " starting at the shard's first element, so "
                "another sharding moves the block boundaries, and the state could only be re-quantised, which "
                "changes its values. Resume on the same world size with the same wrapper, or load the weights only "
                "(load(path, model=model)) and start the optimizer afresh"
            )
        base = f"{PREFIX}/{source}/{key}/rank{rank}"
        if desc is None:  # a plain shard: read as it is
            desc = {"shape": list(shape), "plain": True}
    if list(shape) != list(desc["shape"]):
        raise CheckpointError(f"{where}: the saved {cls_name} has shape {tuple(desc['shape'])}, the parameter "
                              f"{tuple(shape)}")
    device = p.to_local().device if is_dtensor(p) else p.device
    inner: dict[str, torch.Tensor] = {}
    for path in [PLAIN_SHARD] if desc.get("plain") else inner_paths(desc):
        md = src.tensor_meta(f"{base}/{path}")
        if md is None:
            raise src.error(f"{base}/{path} ({cls_name}'s {path} of {target}) is missing")
        inner[path] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
        src.read_into(f"{base}/{path}", inner[path], f"{cls_name} {path} of {target}")

    def build() -> torch.Tensor:
        local = inner[PLAIN_SHARD] if desc.get("plain") else unflatten(desc, inner, where)
        if not is_dtensor(p):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    return build

"""The pieces of training state a checkpoint holds, each as a symmetric pair: ``collect`` (save) and ``plan``
(load, returning what to do after the tensors are read).

``plan`` does every check its component needs and registers the tensors to read; nothing is modified until all
components have planned and the one DCP read has run. Order matters only for ``apply``: the optimizer before its
schedulers.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _optim_state, _ranks
from ._names import canonical_names
from ._request import LoadRequest, SaveRequest
from ._transfer import Snapshot, Source

__all__: list[str] = []

Apply = Callable[[], None]


# -- model and averaged model: loaded in place by the read itself ------------------------------------------------
def collect_model(req: SaveRequest, snap: Snapshot) -> None:
    named = canonical_names(req.objects.module.state_dict().items(), "model")
    snap.tensors.update({f"model/{name}": t for name, t in named.items()})
    snap.plain["model"] = sorted(named)


def plan_model(req: LoadRequest, src: Source) -> Apply | None:
    targets = canonical_names(req.objects.module.state_dict().items(), "model")
    for t, s in src.match(list(targets), src.plain["model"], "model").items():
        src.read_into(f"model/{s}", targets[t], t)
    return None


def collect_averaged(req: SaveRequest, snap: Snapshot) -> None:
    if req.objects.averaged_model is not None:
        named = canonical_names(req.objects.averaged_model.state_dict().items(), "averaged_model")
        snap.tensors.update({f"averaged/{name}": t for name, t in named.items()})


def plan_averaged(req: LoadRequest, src: Source) -> Apply | None:
    if req.objects.averaged_model is None:
        return None
    saved = src.saved_keys("averaged/")
    if not saved:
        raise src.error("holds no averaged model (none was saved)")
    targets = canonical_names(req.objects.averaged_model.state_dict().items(), "averaged_model")
    for t, s in src.match(list(targets), saved, "averaged model").items():
        src.read_into(f"averaged/{s}", targets[t], f"averaged {t}")
    return None


# -- schedulers and grad scaler: plain data --------------------------------------------------------------------
def collect_schedulers(req: SaveRequest, snap: Snapshot) -> None:
    snap.plain["schedulers"] = [s.state_dict() for s in req.objects.schedulers]


def plan_schedulers(req: LoadRequest, src: Source) -> Apply | None:
    schedulers, saved = req.objects.schedulers, src.plain.get("schedulers", [])
    if not schedulers:
        return None
    if len(schedulers) != len(saved):
        raise src.error(f"holds {len(saved)} scheduler state(s); {len(schedulers)} given")

    def apply() -> None:
        for sched, state in zip(schedulers, saved):
            sched.load_state_dict(state)

    return apply


def collect_scaler(req: SaveRequest, snap: Snapshot) -> None:
    scaler = req.objects.grad_scaler
    snap.plain["grad_scaler"] = scaler.state_dict() if scaler is not None else None


def plan_scaler(req: LoadRequest, src: Source) -> Apply | None:
    scaler = req.objects.grad_scaler
    if scaler is None:
        return None
    saved = src.required("grad_scaler", "grad scaler state")
    return lambda: scaler.load_state_dict(saved)


# -- RNG: tensors per rank, Python/NumPy states per rank as plain data ----------------------------------------------
def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _plain_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (name, keys.tolist(), pos, has_gauss, gauss)
    return out


def _set_plain_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def collect_rng(req: SaveRequest, snap: Snapshot) -> None:
    """Collective: the Python/NumPy states of every rank are gathered into the plain data."""
    rank = _ranks.rank(req.process_group)
    snap.tensors.update({f"rng/{rank}/{kind}": t for kind, t in _rng_tensors().items()})
    snap.plain["rng"] = _ranks.all_gather(_plain_rng(), req.process_group)


def plan_rng(req: LoadRequest, src: Source) -> Apply | None:
    """Rank ``r`` gets the states of saved rank ``r % saved_world_size``."""
    if not req.restore_rng:
        return None
    rank = _ranks.rank(req.process_group)
    saved_from = rank % int(src.plain.get("world_size", 1))
    targets: dict[str, torch.Tensor] = {}
    for kind, current in _rng_tensors().items():
        key = f"rng/{saved_from}/{kind}"
        if src.tensor_meta(key) is not None:
            targets[kind] = torch.empty_like(current)
            src.read_into(key, targets[kind], f"rng {kind}")
    saved_plain = src.plain.get("rng") or []

    def apply() -> None:
        if "cpu" in targets:
            torch.set_rng_state(targets["cpu"])
        if "cuda" in targets:
            torch.cuda.set_rng_state(targets["cuda"])
        if saved_plain:
            _set_plain_rng(saved_plain[rank % len(saved_plain)])

    return apply


class Component(NamedTuple):
    name: str
    collect: Callable[[SaveRequest, Snapshot], None]
    plan: Callable[[LoadRequest, Source], Apply | None]


COMPONENTS = (
    Component("model", collect_model, plan_model),
    Component("averaged model", collect_averaged, plan_averaged),
    Component("optimizer", _optim_state.collect, _optim_state.plan),
    Component("schedulers", collect_schedulers, plan_schedulers),
    Component("grad scaler", collect_scaler, plan_scaler),
    Component("rng", collect_rng, plan_rng),
)

"""Make it fit: the settings of a job that keep each device under a memory budget, ranked by estimated step time.

:func:`fit_settings` searches settings the caller lists, given how to plan each (``plan_for``: ``plan()``'s
arguments); :func:`fit` lists them for a model, a global batch and a world (layouts, micro-batch x accumulation,
activation checkpointing per block, parameter dtype, autocast, optimizer-state precision, clip mode, bucket cap).

Not every setting is traced. Memory is additive in its parts, and each part scales simply: parameters, gradients
and optimizer state do not depend on the micro-batch; activations grow linearly with it and with the number of
blocks not checkpointed. So, per group of settings that differ only in micro-batch and checkpointing (and whether
they accumulate, which holds every gradient), the smallest and largest micro-batch are traced with no block and
with every block checkpointed; the rest are interpolated linearly ("derived"). Those ranked best are then traced
themselves before one is recommended, and a setting whose parameters alone exceed the budget is not traced at all
("bound"). Cost: the traced warm step's FLOPs (``torch.utils.flop_counter``'s formulas: the recomputation of checkpointed blocks and
``two_pass``'s second backward are in it, as run) at the device's peak, plus the bytes its collectives move over
the device's link; the two are added (no overlap assumed).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dist_optim._planner._fit_types import (
    DEVICES,
    FitCandidate,
    FitResult,
    FitSetting,
    parse_memory,
)
from dist_optim._planner._plan import trace_in_backward

__all__: list[str] = []

logger = logging.getLogger(__name__)
HEADROOM = 0.10  # docs/planning.md, "Make it fit": what the plan cannot see, on CUDA


def fit_settings(settings: Sequence[FitSetting], plan_for: Callable[..., dict[str, Any]], *,
                 memory: int | float | str, params_bytes: Callable[[FitSetting], int] | None = None,
                 headroom: float = HEADROOM, device: str = "auto", verify: int = 2,
                 argv_for: Callable[[FitSetting], list[str]] | None = None, blocks: int | None = None,
                 workers: int | None = None) -> FitResult:
    """Plan each of ``settings`` (traced or derived, see the module's docstring), keep those under ``memory``
    less ``headroom``, rank them by estimated step time, and trace the best ``verify`` themselves.

    ``plan_for(setting)`` gives :func:`dist_optim.plan`'s arguments for the setting (not ``"pp"``);
    ``params_bytes(setting)``, if given, the bytes of parameters one device holds, a bound that spares a trace
    (with the optimizer state's bytes per parameter byte, once a trace has shown them);
    ``argv_for(setting)`` the command line that runs it (kept in each candidate). ``blocks``: the model's number
    of identical blocks, given when ``plan_for(setting, depth=d)`` builds the model with ``d`` of them (and
    ``checkpoint_blocks`` counted among those): the groups' corners are then traced at depths 2 and 4 and
    extrapolated to ``blocks`` (each part of the memory grows linearly with the blocks), which is what makes a
    deep model quick to search. ``workers``: processes tracing at once (forked; default: up to 8, one per core,
    where the platform forks and CUDA is not initialized; 1: all in this process)."""
    budget = parse_memory(memory)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}: the fraction of the budget kept free")
    device = _device(device)
    t0 = time.perf_counter()
    search = _Search(plan_for, device, blocks)
    search.plan_groups(settings)
    usable = int(budget * (1 - headroom))
    settings = list(dict.fromkeys(settings))  # in order, once each
    for s in settings:  # the first trace shows the state's bytes per parameter byte, which the bounds then count
        if (search.bound(s, params_bytes(s)) if params_bytes is not None else 0) <= usable:
            search.run(*search.needs(s)[:1])
            break
    bounds = {s: search.bound(s, params_bytes(s)) if params_bytes is not None else 0 for s in settings}
    search.prefetch([s for s in settings if bounds[s] <= usable], _workers(workers))
    out = []
    for s in settings:
        c = FitCandidate(s, bounds[s], "bound") if bounds[s] > usable else search.candidate(s)
        c.argv = argv_for(s) if argv_for is not None else []
        out.append(c)
    for _ in range(len(out)):  # the best that fit, traced themselves; then ranked again
        _rank(out, usable)
        derived = [i for i, c in enumerate(out[:verify]) if c.fits and c.planned_by == "derived"]
        if not derived:
            break
        for i in derived:
            traced = search.traced(out[i].setting)
            out[i] = dataclasses.replace(traced, argv=out[i].argv)
    _rank(out, usable)
    if all(c.planned_by == "bound" for c in out):  # the smallest figure said is a plan, not a bound
        i = min(range(len(out)), key=lambda i: out[i].planned_peak_bytes)
        out[i] = dataclasses.replace(search.traced(out[i].setting), argv=out[i].argv)
        _rank(out, usable)
    return FitResult(budget, headroom, out, device, search.count, round(time.perf_counter() - t0, 1))


def _rank(candidates: list[FitCandidate], usable: int) -> None:
    for c in candidates:
        c.fits = c.planned_by != "bound" and c.planned_peak_bytes <= usable
    candidates.sort(key=lambda c: (not c.fits, c.cost_seconds if c.fits else c.planned_peak_bytes,
                                   c.planned_peak_bytes))


def _device(device: str) -> str:
    if device == "auto":
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name().lower()
            return next((k for k in DEVICES if k in name), "h100")
        return "cpu"
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto' or one of {sorted(DEVICES)}, got {device!r}")
    return device


class _Search:
    """Traces on demand, each setting once, and derives the others from them."""

    DEPTHS = (2, 4)  # the depths a deep model's corners are traced at

    def __init__(self, plan_for: Callable[..., dict[str, Any]], device: str, blocks: int | None) -> None:
        self.plan_for, self.device, self.count = plan_for, device, 0
        self.blocks = blocks if blocks is not None and blocks > 2 * self.DEPTHS[-1] else None
        self.memo: dict[FitSetting, FitCandidate] = {}
        self.shallow: dict[tuple[FitSetting, int], FitCandidate] = {}
        self.group_of: dict[FitSetting, tuple[int, int, int, int]] = {}
        self.state_ratio: dict[tuple[str, str], float] = {}  # optimizer state / parameter bytes, as traced

    def bound(self, s: FitSetting, params: int) -> int:
        """What ``s`` holds at least: its parameters, and its state once a trace of its kind has shown the ratio."""
        return int(params * (1 + self.state_ratio.get((s.state, s.param_dtype), 0.0)))

    def traced(self, s: FitSetting) -> FitCandidate:
        if s not in self.memo or self.memo[s].planned_by != "traced":
            self.memo[s] = self._trace(s, None)
        return self.memo[s]

    def run(self, job: tuple[FitSetting, int | None]) -> None:
        """One trace ``needs`` listed, kept."""
        s, depth = job
        if depth is None:
            self.traced(s)
        elif (s, depth) not in self.shallow:
            self.shallow[s, depth] = self._trace(_shallow(s, depth, self.blocks), depth)

    def _trace(self, s: FitSetting, depth: int | None) -> FitCandidate:
        logger.info("fit: tracing %s%s", s.describe(), "" if depth is None else f" at {depth} blocks")
        arguments = self.plan_for(s) if depth is None else self.plan_for(s, depth=depth)
        plan, n_params = trace_in_backward(**arguments, first_step=depth is None)
        self.count += 1
        flops, comm = plan.counts["flops"], plan.counts["collective_bytes"]
        if s.parallel == "ddp":  # the planner's DDP reduces without a collective: a ring all-reduce's bytes
            comm += 2 * n_params * (2 if s.param_dtype == "bfloat16" else 4)
        held = plan.breakdown
        if held["parameters"]:
            key = (s.state, s.param_dtype)
            ratio = held["optimizer_state"] / held["parameters"]
            self.state_ratio[key] = min(ratio, self.state_ratio.get(key, ratio))
        # a shallow trace is extrapolated from its warm step: the first step's figure of a trace depends on what
        # the process traced before (docs/planning.md), which extrapolation would magnify
        peak = plan.run_peak_bytes if depth is None else plan.peak_bytes
        return FitCandidate(s, peak, "traced", flops=flops, collective_bytes=comm,
                            cost_seconds=self.seconds(s, flops, comm))

    def shallow_ok(self, s: FitSetting) -> bool:
        """Whether ``s`` is extrapolated from shallow traces: a deep model whose shallow copies can checkpoint the
        same share of their blocks."""
        return self.blocks is not None and (s.checkpoint_blocks * self.DEPTHS[0]) % self.blocks == 0

    def corner(self, s: FitSetting) -> FitCandidate:
        """A group's corner: traced, or for a deep model extrapolated from two shallow traces of it."""
        if s in self.memo or not self.shallow_ok(s):
            return self.traced(s)
        d1, d2 = self.DEPTHS
        for d in (d1, d2):
            self.run((s, d))
        shallow = [self.shallow[s, d1], self.shallow[s, d2]]
        w = (self.blocks - d1) / (d2 - d1)

        def value(get: Callable[[FitCandidate], float]) -> float:
            return get(shallow[0]) + w * (get(shallow[1]) - get(shallow[0]))
        flops, comm = value(lambda c: c.flops), value(lambda c: c.collective_bytes)
        return FitCandidate(s, int(value(lambda c: c.planned_peak_bytes)), "derived", flops=flops,
                            collective_bytes=comm, cost_seconds=self.seconds(s, flops, comm))

    def needs(self, s: FitSetting) -> list[tuple[FitSetting, int | None]]:
        """The traces ``candidate(s)`` reads: (setting, depth), depth ``None`` for the model's own."""
        group = self.group_of.get(s)
        corners = [s] if group is None else [_at(s, m, k) for m in {group[0], group[1]} for k in {group[2], group[3]}]
        out: list[tuple[FitSetting, int | None]] = []
        for c in corners:
            if c in self.memo or not self.shallow_ok(c):
                out += [] if c in self.memo else [(c, None)]
            else:
                out += [(c, d) for d in self.DEPTHS if (c, d) not in self.shallow]
        return out

    def prefetch(self, settings: Sequence[FitSetting], workers: int) -> None:
        """Trace what ``settings`` need, ``workers`` processes at once (forked: each a copy of this search)."""
        jobs = list(dict.fromkeys(j for s in settings for j in self.needs(s)))
        if workers < 2 or len(jobs) < 2:
            return  # traced as candidate() needs them
        global _FORKED
        _FORKED = self
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(jobs)), _forked_start) as pool:
                for (s, depth), traced, ratios in pool.imap_unordered(_trace_forked, jobs):
                    self.count += 1
                    if depth is None:
                        self.memo[s] = traced
                    else:
                        self.shallow[s, depth] = traced
                    for key, ratio in ratios.items():
                        self.state_ratio[key] = min(ratio, self.state_ratio.get(key, ratio))
        finally:
            _FORKED = None

    def seconds(self, s: FitSetting, flops: float, comm: float) -> float:
        fp32, bf16, intra, inter = DEVICES[self.device]
        peak = bf16 if s.param_dtype != "float32" or s.autocast else fp32
        link = intra if s.world_size <= 8 else inter  # a node of up to 8 devices
        return flops / peak + comm / link

    def candidate(self, s: FitSetting) -> FitCandidate:
        """``s`` derived from up to four traced settings of its group (or traced, when it is one of them)."""
        group = self.group_of.get(s)
        if group is None:
            return self.corner(s)
        micro_lo, micro_hi, k_lo, k_hi = group
        corners = {(m, k): self.corner(_at(s, m, k)) for m in {micro_lo, micro_hi} for k in {k_lo, k_hi}}
        if (s.micro_batch, s.checkpoint_blocks) in corners:
            return corners[s.micro_batch, s.checkpoint_blocks]

        def value(get: Callable[[FitCandidate], float]) -> float:
            def at_k(m: int) -> float:
                ks = sorted(k for mm, k in corners if mm == m)
                lo, hi = ks[0], ks[-1]
                w = 0.0 if hi == lo else (s.checkpoint_blocks - lo) / (hi - lo)
                return (1 - w) * get(corners[m, lo]) + w * get(corners[m, hi])
            w = 0.0 if micro_hi == micro_lo else (s.micro_batch - micro_lo) / (micro_hi - micro_lo)
            return (1 - w) * at_k(micro_lo) + w * at_k(micro_hi)
        flops, comm = value(lambda c: c.flops), value(lambda c: c.collective_bytes)
        return FitCandidate(s, int(value(lambda c: c.planned_peak_bytes)), "derived", flops=flops,
                            collective_bytes=comm, cost_seconds=self.seconds(s, flops, comm))

    def plan_groups(self, settings: Sequence[FitSetting]) -> None:
        """Group ``settings`` that differ only in micro-batch and checkpointing (and accumulate alike): each is
        derived from its group's smallest and largest micro-batch, at its fewest and most checkpointed blocks."""
        groups: dict[FitSetting, list[FitSetting]] = {}
        for s in settings:
            groups.setdefault(_at(s, 0, 0, accumulating=s.accumulation_steps > 1), []).append(s)
        self.group_of = {}
        for members in groups.values():
            micros = sorted({s.micro_batch for s in members})
            ks = sorted({s.checkpoint_blocks for s in members})
            for s in members:
                self.group_of[s] = (micros[0], micros[-1], ks[0], ks[-1])


_FORKED: _Search | None = None  # the search a forked worker traces for


def _forked_start() -> None:
    # one intra-op thread a worker (one worker a core): the OpenMP pool the parent's real runs (the planner's
    # calibrations) made does not survive the fork, and a parallel kernel in the child waits on it for ever
    torch.set_num_threads(1)


def _trace_forked(job: tuple[FitSetting, int | None]) -> tuple[tuple[FitSetting, int | None], FitCandidate, dict]:
    s, depth = job
    assert _FORKED is not None
    traced = _FORKED._trace(s if depth is None else _shallow(s, depth, _FORKED.blocks), depth)
    return job, traced, _FORKED.state_ratio


def _shallow(s: FitSetting, depth: int, blocks: int | None) -> FitSetting:
    """``s`` on a model of ``depth`` of its ``blocks``: the same share of them checkpointed."""
    assert blocks
    return dataclasses.replace(s, checkpoint_blocks=s.checkpoint_blocks * depth // blocks)


def _workers(workers: int | None) -> int:
    if workers is not None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        return workers
    if "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.is_initialized():
        return 1  # a forked child cannot use CUDA its parent initialized
    return max(1, min(8, os.cpu_count() or 1))


def _at(s: FitSetting, micro: int, blocks: int, accumulating: bool | None = None) -> FitSetting:
    """``s`` at another micro-batch (the same samples per step) and checkpointing; ``accumulating`` given: the
    group's key (micro-batch and accumulation blanked, only whether it accumulates kept)."""
    if accumulating is not None:
        return dataclasses.replace(s, micro_batch=0, accumulation_steps=2 if accumulating else 1,
                                   checkpoint_blocks=0)
    per_rank = s.micro_batch * s.accumulation_steps
    return dataclasses.replace(s, micro_batch=micro, accumulation_steps=per_rank // micro, checkpoint_blocks=blocks)

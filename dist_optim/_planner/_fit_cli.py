"""``python -m dist_optim.plan --fit --memory MEM``: the search of ``dist_optim.fit`` from the planner's command
line (its model options), the table or JSON out, exit code 3 when nothing fits."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dist_optim._planner._fit_model import fit
from dist_optim._planner._fit_types import ALLOW, DEVICES, FitResult

__all__: list[str] = []

NO_FIT = 3  # the exit code when no candidate fits the budget


def fit_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--fit: search the settings that fit a memory budget (docs/planning.md, Make it fit)")
    g.add_argument("--fit", action="store_true", help="search instead of planning one setting: layout, micro-batch x "
                   "accumulation, activation checkpointing, clip mode (and with --allow: dtypes, low-bit states)")
    g.add_argument("--memory", metavar="MEM", help="--fit: the budget per device, e.g. 80GiB, 512MiB")
    g.add_argument("--devices", type=int, default=1, help="--fit: devices per node")
    g.add_argument("--nodes", type=int, default=1, help="--fit: nodes")
    g.add_argument("--global-batch", type=int, default=None, help="--fit: sequences per optimizer step over the "
                   "whole job (default: --batch-size x --accumulation-steps)")
    g.add_argument("--allow", default="", metavar="NAMES", help=f"--fit: settings that change the job's arithmetic, "
                   f"comma-separated: {', '.join(ALLOW)} (default: only settings bitwise equal to the job asked for)")
    g.add_argument("--headroom", type=float, default=0.1, help="--fit: the fraction of --memory kept free for what "
                   "the plan cannot see")
    g.add_argument("--cost-device", choices=("auto", *DEVICES), default="auto",
                   help="--fit: the device whose peak FLOP/s and link speed turn FLOPs and bytes into time")


def run_fit(args: argparse.Namespace, model_fn: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor],
            vocab: int, seq_len: int, optimizer_class: type, parallelize: Any,
            progress: contextlib.AbstractContextManager) -> FitResult:
    if not args.memory:
        raise ValueError("--fit needs --memory MEM, the budget per device (e.g. 80GiB)")

    def batch_fn(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, (n, seq_len)), torch.randint(0, vocab, (n, seq_len))
    with progress:
        result = fit(model_fn, batch_fn, loss_fn, optimizer_class, memory=args.memory,
                     global_batch=args.global_batch or args.batch_size * args.accumulation_steps,
                     devices=args.devices, nodes=args.nodes, allow=args.allow, max_grad_norm=args.max_grad_norm,
                     headroom=args.headroom, device=args.cost_device, parallelize=parallelize,
                     bucket_caps=(args.bucket_cap_mb,), lr=args.lr)
    write_json(args.json, result.to_dict(), result.table())
    if result.fits:
        sys.stdout.write(f"run: {result.best.call}\n")
    if args.plot:
        with contextlib.suppress(ImportError):
            result.plot(args.plot)
    if not result.fits:
        raise SystemExit(NO_FIT)
    return result


def write_json(where: str | None, data: dict[str, Any], table: str) -> None:
    """The table on stdout, and the JSON: instead of it (``where == "-"``), or into the file ``where``."""
    if where == "-":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    sys.stdout.write(table + "\n")
    if where:
        pathlib.Path(where).write_text(json.dumps(data, indent=1) + "\n")

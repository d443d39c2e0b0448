"""``--optimizer NAME``: the optimizer class the job trains with, in backward or in the standard loop alike.

Each name maps to one class and the options the job gives it (``--lr``, ``--beta1``/``--beta2``,
``--weight-decay``). The classes outside torch come from the ``optimizers`` extra; a class whose package is not
installed is a one-line error naming the extra. The bytes a loop holds per parameter, counted from its tensors
(``persistent_bytes``), are what ``--compare`` reports beside its measured peaks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .runtime import LaunchError

__all__ = ["OPTIMIZERS", "bytes_markdown", "bytes_per_param", "optimizer_class", "optimizer_kwargs",
           "persistent_bytes", "plain_tensors"]


@dataclass(frozen=True)
class Choice:
    module: str
    name: str
    what: str
    extra: str | None = None  # the pyproject extra that installs the module (None: torch itself)


# the --optimizer choices; the first is the default
OPTIMIZERS: dict[str, Choice] = {
    "adamw": Choice("torch.optim", "AdamW", "torch's AdamW, fused on CPU and CUDA"),
    "adamw8bit": Choice("torchao.optim", "AdamW8bit", "torchao's AdamW with 8-bit states", "optimizers"),
    "adamw4bit": Choice("torchao.optim", "AdamW4bit", "torchao's AdamW with 4-bit states", "optimizers"),
    "lion": Choice("pytorch_optimizer", "Lion", "pytorch-optimizer's Lion (betas from --beta1, --beta2)",
                   "optimizers"),
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class ``--optimizer name`` trains with; a LaunchError naming the extra when its package is missing."""
    choice = OPTIMIZERS[name]
    try:
        module = importlib.import_module(choice.module)
    except ImportError as e:
        package = choice.module.split(".")[0]
        raise LaunchError(f"--optimizer {name} needs the {package} package, which is not importable ({e}): "
                          f"pip install -e '.[{choice.extra}]'") from e
    return getattr(module, choice.name)


def optimizer_kwargs(name: str, cfg: Any, device: torch.device) -> dict[str, Any]:
    """The options the job gives ``name``'s class (the same in both loops)."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay}
    if name == "adamw":
        kwargs["fused"] = device.type in ("cpu", "cuda")
    return kwargs


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind ``t``: a DTensor's local shard, a quantised state's codes, scales and code map."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):  # a DTensor: this rank's shard
        return plain_tensors(t.to_local())
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [x for v in inner if isinstance(v, torch.Tensor) for x in plain_tensors(v)]
    return [t]


def persistent_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the parameters and of the optimizer's state tensors, each storage counted once, and the
    number of parameter elements they hold."""
    seen: set[int] = set()

    def size(tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    local = [x for p in params for x in plain_tensors(p.detach())]
    states = [x for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)
              for x in plain_tensors(v)]
    return {"params": size(local), "states": size(states), "numel": sum(t.numel() for t in local)}


def bytes_per_param(persistent: list[dict[str, dict[str, int]]], peaks: dict[str, list[int]]) -> dict[str, Any]:
    """``--compare``'s bytes per parameter, per rank and loop: the parameters and states counted from their tensors
    (``persistent``: each rank's :func:`persistent_bytes` per loop), then with the profiled step's peak above them
    (``peaks``: per loop, per rank; activations, gradients and the step's temporaries)."""
    loops = list(peaks)
    held = {m: [(r[m]["params"] + r[m]["states"]) / r[m]["numel"] for r in persistent] for m in loops}
    return {
        "bytes_per_param": {m: [(r[m]["params"] + r[m]["states"] + peak) / r[m]["numel"]
                                for r, peak in zip(persistent, peaks[m])] for m in loops},
        "params_and_states_bytes_per_param": held,
        "persistent_bytes_per_rank": {m: [r[m] for r in persistent] for m in loops},
    }


def bytes_markdown(report: dict[str, Any]) -> str:
    """The report's section on bytes per parameter."""
    b, held = report["bytes_per_param"], report["params_and_states_bytes_per_param"]
    rows = "\n".join(f"| {k} | {held['standard'][k]:.3f} | {held['in_backward'][k]:.3f} | {b['standard'][k]:.3f} | "
                     f"{b['in_backward'][k]:.3f} |" for k in range(len(b["standard"])))
    return f"""
## Bytes per parameter (`--optimizer {report['config']['optimizer']}`)

Parameters and optimizer states counted from their tensors (this rank's shards; quantised states with their scales),
then with the profiled step's peak above them (activations, gradients, the step's temporaries), over this rank's
parameter count.

| rank | params + states, standard | params + states, in backward | step peak, standard | step peak, in backward |
|---|---|---|---|---|
{rows}
"""

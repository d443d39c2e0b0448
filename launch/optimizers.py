"""``--optimizer NAME``: the optimizer class the job trains with, in backward or in the standard loop alike.

Each name maps to one class and the options the job gives it (``--lr``, ``--beta1``/``--beta2``,
``--weight-decay``); ``muon`` maps to two: ``torch.optim.Muon`` for the blocks' 2-D weight matrices, AdamW for the
rest, as param groups (:func:`param_groups`; the standard loop steps them with :class:`GroupClasses`). The classes
outside torch come from the ``optimizers`` extra; a class whose package is not installed is a one-line error naming
the extra. The bytes a loop holds per parameter, counted from its tensors (``persistent_bytes``), are what
``--compare`` reports beside its measured peaks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .runtime import LaunchError

__all__ = ["OPTIMIZERS", "GroupClasses", "bytes_markdown", "bytes_per_param", "check_parallel", "optimizer_class",
           "optimizer_kwargs", "param_groups", "persistent_bytes", "plain_tensors", "standard_optimizer"]


@dataclass(frozen=True)
class Choice:
    module: str
    name: str  # the class of every parameter, or of those the matrices' class does not take
    what: str
    extra: str | None = None  # the pyproject extra that installs the module (None: torch itself)
    matrices: str | None = None  # a torch.optim class for the blocks' 2-D weight matrices, in a group of their own


# the --optimizer choices; the first is the default
OPTIMIZERS: dict[str, Choice] = {
    "adamw": Choice("torch.optim", "AdamW", "torch's AdamW, fused on CPU and CUDA"),
    "adamw8bit": Choice("torchao.optim", "AdamW8bit", "torchao's AdamW with 8-bit states", "optimizers"),
    "adamw4bit": Choice("torchao.optim", "AdamW4bit", "torchao's AdamW with 4-bit states", "optimizers"),
    "lion": Choice("pytorch_optimizer", "Lion", "pytorch-optimizer's Lion (betas from --beta1, --beta2)",
                   "optimizers"),
    "muon": Choice("torch.optim", "AdamW", "torch's Muon for the blocks' 2-D weight matrices (lr and weight decay "
                   "from --lr, --weight-decay, scaled to AdamW's update size), fused AdamW for the embeddings, "
                   "head, norms and biases", matrices="Muon"),
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
    if name in ("adamw", "muon"):
        kwargs["fused"] = device.type in ("cpu", "cuda")
    return kwargs


def check_parallel(name: str, parallel: str) -> None:
    """``--optimizer muon`` trains on one process: its two classes are param groups, and under DDP and pipeline
    stages the in-backward optimizer takes the model whole (no groups), while FSDP2 and tensor parallel would run
    Muon's Newton-Schulz iterations on DTensors, which this job does not test."""
    if OPTIMIZERS[name].matrices is not None and parallel != "none":
        raise LaunchError(f"--optimizer {name} trains on one process (--parallel none): its Muon and AdamW param "
                          f"groups cannot be given with a DDP model or pipeline stages, and Muon under FSDP2 or "
                          f"tensor parallel is not tested here; got --parallel {parallel}")


def param_groups(name: str, model: nn.Module, cfg: Any) -> list[dict[str, Any]] | None:
    """``name``'s param groups over ``model`` (named): for ``muon``, the blocks' 2-D weight matrices with
    ``torch.optim.Muon`` (``"optimizer_class"``; ``adjust_lr_fn="match_rms_adamw"`` scales its update to AdamW's
    size, so that ``--lr`` and ``--weight-decay`` serve both), then every other parameter with the job's AdamW
    options. ``None`` for a name of one class: the optimizer takes the model whole."""
    matrices = OPTIMIZERS[name].matrices
    if matrices is None:
        return None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [(n, p) for n, p in named if n.startswith("blocks.") and p.ndim == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("blocks.") and p.ndim == 2)]
    muon = {"params": hidden, "optimizer_class": getattr(torch.optim, matrices), "lr": cfg.lr,
            "weight_decay": cfg.weight_decay, "adjust_lr_fn": "match_rms_adamw"}
    return [muon, {"params": rest}]


def standard_optimizer(name: str, model: nn.Module, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """The standard loop's optimizer for ``--optimizer name``: the class over the model's parameters, or
    :class:`GroupClasses` over :func:`param_groups`."""
    cls, kwargs = optimizer_class(name), optimizer_kwargs(name, cfg, device)
    groups = param_groups(name, model, cfg)
    return cls(model.parameters(), **kwargs) if groups is None else GroupClasses(groups, cls, **kwargs)


class GroupClasses(torch.optim.Optimizer):
    """The standard loop's optimizer for param groups of several classes (``--optimizer muon``), as
    ``InBackwardOptimizer`` takes them: a group's ``"optimizer_class"`` (else ``optimizer_class``, with
    ``optimizer_kwargs``) fills in its defaults. ``step()`` steps one optimizer of each group's class over that
    group, in the groups' order, as a loop holding a Muon and an AdamW optimizer steps one then the other; the
    groups and the state are this optimizer's, so that one LR scheduler, one state dict and one checkpoint cover
    them all."""

    def __init__(self, params: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                 **optimizer_kwargs: Any) -> None:
        self._parts: list[torch.optim.Optimizer] = []  # per group: an optimizer of its class
        for group in params:
            group = dict(group)
            cls = group.pop("optimizer_class", optimizer_class)
            self._parts.append(cls([group], **(optimizer_kwargs if cls is optimizer_class else {})))
        super().__init__([part.param_groups[0] for part in self._parts], {})

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("GroupClasses.step takes no closure")
        for part, group in zip(self._parts, self.param_groups):
            # this optimizer's groups and state (load_state_dict replaces both)
            part.param_groups, part.state = [group], self.state
            part.step()
        return None


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

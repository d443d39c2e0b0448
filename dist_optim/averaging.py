"""EMA and SWA of the parameters, updated inside ``backward()`` right after each bucket is stepped.

:func:`average_in_backward` keeps a ``torch.optim.swa_utils.AveragedModel`` up to date while an
:class:`~dist_optim.InBackwardOptimizer` steps: each bucket is averaged as soon as it is stepped, the parameters not
stepped this time and the buffers when the training step ends, bitwise as ``update_parameters(model)`` after a step.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils.hooks import RemovableHandle

from dist_optim._torch_internals import (
    foreach_supported_devices,
    group_tensors_by_device_and_dtype,
    tensor_version,
)
from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["average_in_backward"]

# averaged model -> (weakref to the optimizer that keeps it up to date, the hooks' handle there)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def average_in_backward(
    optimizer: InBackwardOptimizer, averaged_model: AveragedModel, model: nn.Module
) -> RemovableHandle:
    """Keep ``averaged_model`` updated inside ``backward()`` as if ``averaged_model.update_parameters(model)``
    were called after every training step of ``optimizer``.

    Each parameter of ``model`` is averaged right after its bucket is stepped, while it is still hot; parameters
    not stepped in a training step (unused in that backward, frozen, or stepped by no optimizer) and the buffers
    are done when the training step ends, and ``n_averaged`` then grows by one. The first update copies; later
    ones apply ``averaged_model``'s ``multi_avg_fn`` or ``avg_fn`` (SWA when it has neither) with the same
    arithmetic and grouping as ``update_parameters``, so the averaged model is bitwise the standard loop's.
    ``averaged_model`` stays torch's own object: its ``state_dict()`` (with ``n_averaged``),
    ``torch.optim.swa_utils.update_bn`` and inference work as usual.

    Attach when averaging should start (SWA from epoch ``k``: attach after epoch ``k - 1``), and call
    ``.remove()`` on the handle to stop. A custom ``multi_avg_fn`` is called once per bucket on that bucket's
    tensors, so it must treat each tensor on its own, as all of torch's do.

    Args:
        optimizer: the :class:`~dist_optim.InBackwardOptimizer` that trains ``model``.
        averaged_model: a ``torch.optim.swa_utils.AveragedModel`` built from ``model`` (or loaded from a checkpoint
            of one), on any device.
        model: the model being trained; its parameters (and buffers) are paired with ``averaged_model``'s in
            order, as ``update_parameters`` pairs them.

    Returns:
        A handle whose ``remove()`` stops the averaging; ``averaged_model`` keeps what it has averaged so far.

    Raises:
        TypeError: ``optimizer`` is not an ``InBackwardOptimizer``, ``averaged_model`` is not an ``AveragedModel``
            or ``model`` is not an ``nn.Module``.
        ValueError: the parameters or buffers of ``averaged_model`` do not correspond to ``model``'s (count or
            shapes); ``optimizer`` steps none of ``model``'s parameters; ``averaged_model`` is already kept up to
            date in backward.

    Example:
        >>> import torch, dist_optim
        >>> from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        >>> from dist_optim.averaging import average_in_backward
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2)
        >>> ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
        >>> handle = average_in_backward(opt, ema, model)
        >>> for _ in range(3):
        ...     model(torch.randn(8, 4)).square().mean().backward()  # steps, then averages, bucket by bucket
        >>> int(ema.n_averaged), torch.equal(ema.module.weight, model.weight)
        (3, False)
        >>> handle.remove()  # averaging stops; ema keeps its values
    """
    if not isinstance(optimizer, InBackwardOptimizer):
        raise TypeError(
            f"optimizer must be a dist_optim.InBackwardOptimizer, got {type(optimizer).__name__}; with a standard "
            "optimizer call averaged_model.update_parameters(model) after each optimizer.step()"
        )
    if not isinstance(averaged_model, AveragedModel):
        raise TypeError(
            f"averaged_model must be a torch.optim.swa_utils.AveragedModel, got {type(averaged_model).__name__}; "
            "build one from the model, e.g. AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if model is averaged_model or model is averaged_model.module:
        raise ValueError("model is the averaged model itself; pass the model that the optimizer trains")
    _check_correspondence(averaged_model, model)
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not any(id(p) in known for p in model.parameters()):
        raise ValueError(
            "optimizer steps none of model's parameters, so nothing would be averaged in backward; pass the model "
            "whose parameters this optimizer trains"
        )
    previous = _ATTACHED.get(averaged_model)
    if previous is not None:
        other = previous[0]()
        if other is not None and previous[1].attached:
            raise ValueError(
                f"averaged_model is already averaged in backward by {type(other).__name__} at {hex(id(other))}; "
                "one averaged model follows one optimizer (put all parameters in one InBackwardOptimizer: groups "
                "may carry their own 'optimizer_class'), or call .remove() on the handle of the first call"
            )

    averager = _Averager(averaged_model, model)
    handle = _Hooks([
        optimizer.register_step_pre_hook(averager.begin),
        optimizer.register_bucket_step_hook(averager.bucket_stepped),
        optimizer.register_step_post_hook(averager.end),
    ])
    _ATTACHED[averaged_model] = (weakref.ref(optimizer), handle)
    return handle


class _Hooks(RemovableHandle):
    """One handle for the averager's three hooks (step pre, bucket step, step post)."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        super().__init__(OrderedDict())
        self.handles = handles
        self.attached = True

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.attached = False


def _check_correspondence(averaged_model: AveragedModel, model: nn.Module) -> None:
    fix = (
        "build the averaged model from this model (AveragedModel(model, ...)) or load a checkpoint of one made "
        "from the same architecture"
    )
    for kind, ours, theirs in (
        ("parameters", list(averaged_model.parameters()), list(model.parameters())),
        ("buffers", list(averaged_model.module.buffers()), list(model.buffers())),
    ):
        if len(ours) != len(theirs):
            raise ValueError(f"averaged_model has {len(ours)} {kind} but model has {len(theirs)}; {fix}")
        for k, (a, p) in enumerate(zip(ours, theirs)):
            if a.shape != p.shape:
                raise ValueError(
                    f"{kind} {k} has shape {tuple(a.shape)} in averaged_model but {tuple(p.shape)} in model; {fix}"
                )


class _Step:
    """What one training step needs: the tensor pairs, which parameters are done, and ``n_averaged``."""

    __slots__ = ("averaged", "current", "index", "done", "n", "use_buffers")

    def __init__(self, averaged_model: AveragedModel, model: nn.Module, n: int) -> None:
        self.use_buffers = averaged_model.use_buffers
        # The pairs update_parameters zips; buffers are taken when the step ends.
        self.averaged = list(averaged_model.module.parameters() if self.use_buffers else averaged_model.parameters())
        self.current = list(model.parameters())
        if len(self.averaged) != len(self.current):
            _check_correspondence(averaged_model, model)
        self.index = {id(p): i for i, p in enumerate(self.current)}
        self.done = bytearray(len(self.current))
        self.n = n


class _Averager:
    def __init__(self, averaged_model: AveragedModel, model: nn.Module) -> None:
        self.averaged_model = averaged_model
        self.model = model
        self.step: _Step | None = None
        self.n_seen: tuple[torch.Tensor, int, int] | None = None  # (n_averaged, its version counter, its value)

    # -- hooks ----------------------------------------------------------------------------------------------------
    def begin(self, _optimizer: Any = None, _args: Any = None, _kwargs: Any = None) -> None:
        self.step = _Step(self.averaged_model, self.model, self._n_averaged())

    def bucket_stepped(self, _optimizer: Any, stepped: list[torch.Tensor]) -> None:
        step = self.step
        if step is None:  # attached in the middle of a training step
            self.begin()
            step = self.step
        todo = []
        for p in stepped:
            i = step.index.get(id(p))
            if i is not None and not step.done[i]:
                step.done[i] = 1
                todo.append(i)
        if todo:
            self._average([step.averaged[i] for i in todo], [step.current[i] for i in todo], step.n)

    def end(self, _optimizer: Any = None, _args: Any = None, _kwargs: Any = None) -> None:
        step = self.step
        if step is None:
            self.begin()
            step = self.step
        self.step = None
        rest = [i for i, d in enumerate(step.done) if not d]
        averaged = [step.averaged[i] for i in rest]
        current = [step.current[i] for i in rest]
        am = self.averaged_model
        if step.use_buffers:
            averaged += am.module.buffers()
            current += self.model.buffers()
        self._average(averaged, current, step.n)
        if not step.use_buffers:
            # As update_parameters: buffers are not averaged but kept in sync with the model's.
            with torch.no_grad():
                for b_avg, b_model in zip(am.module.buffers(), self.model.buffers(), strict=True):
                    b_avg.detach().copy_(b_model.detach().to(b_avg.device))
        am.n_averaged += 1
        n = am.n_averaged
        self.n_seen = (n, tensor_version(n), step.n + 1)

    # -- arithmetic: AveragedModel.update_parameters on a subset of the pairs ---------------------------------------
    def _n_averaged(self) -> int:
        n = self.averaged_model.n_averaged
        seen = self.n_seen
        if seen is not None and seen[0] is n and _reading_syncs(n) and seen[1] == tensor_version(n) != -1:
            return seen[2]  # unchanged since we last wrote it: no device sync in backward
        return int(n)

    @torch.no_grad()
    def _average(self, averaged: list[torch.Tensor], current: list[torch.Tensor], n: int) -> None:
        if not averaged:
            return
        am = self.averaged_model
        self_detached = []
        model_detached = []
        for p_averaged, p_model in zip(averaged, current, strict=True):
            p_model_ = p_model.detach().to(p_averaged.device)
            self_detached.append(p_averaged.detach())
            model_detached.append(p_model_)
            if n == 0:
                p_averaged.detach().copy_(p_model_)
        if n <= 0:
            return
        if am.multi_avg_fn is not None or am.avg_fn is None:
            grouped = group_tensors_by_device_and_dtype([self_detached, model_detached])
            for (device, _), ([self_params, model_params], _) in grouped.items():
                if am.multi_avg_fn:
                    am.multi_avg_fn(self_params, model_params, am.n_averaged.to(device))
                elif device is not None and device.type in foreach_supported_devices():
                    get_swa_multi_avg_fn()(self_params, model_params, am.n_averaged.to(device))
                else:
                    avg_fn = get_swa_avg_fn()
                    n_averaged = am.n_averaged.to(device)
                    for p_averaged, p_model in zip(self_params, model_params, strict=True):
                        p_averaged.copy_(avg_fn(p_averaged, p_model, n_averaged))
        else:
            for p_averaged, p_model in zip(self_detached, model_detached, strict=True):
                n_averaged = am.n_averaged.to(p_averaged.device)
                p_averaged.copy_(am.avg_fn(p_averaged, p_model, n_averaged))


def _reading_syncs(t: torch.Tensor) -> bool:
    """Whether reading ``t`` on the host waits for its device (then its value is remembered between steps)."""
    return t.device.type != "cpu"

"""``InBackwardTrainer``: an HF ``transformers.Trainer`` whose optimizer steps in backward, driven by its own
``TrainingArguments``: ``optim`` and its options choose the wrapped optimizer, ``gradient_accumulation_steps`` the
backwards that only accumulate, ``max_grad_norm`` the exact clipping, and the logged ``grad_norm`` is the one
measured inside backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer

from dist_optim._factory import in_backward
from dist_optim._frameworks import register_adapter
from dist_optim.integrations._common import clipping_options, unwrap
from dist_optim.integrations.hf_accelerate import InBackwardAccelerator
from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["InBackwardTrainer"]

# what cancels the memory saving, in TrainingArguments' terms (dist_optim/engine/_saving.py has the engine's)
HF_TERMS = {
    "accumulation": (
        "gradient_accumulation_steps={n} (every gradient stays in .grad across the {n} micro-batches)",
        "gradient_accumulation_steps=1 and a per_device_train_batch_size {n}x larger, with "
        "gradient_checkpointing=True",
    ),
    "exact_clip": (
        "max_grad_norm={n} (the default 1.0 clips by the global norm, clip_mode='exact', which needs every "
        "gradient before the first step)",
        'InBackwardTrainer(..., in_backward_options={{"clip_mode": "two_pass"}}) (one more backward), or '
        "max_grad_norm=0 (no clipping)",
    ),
}


@register_adapter
class InBackwardTrainer(Trainer):
    """A ``Trainer`` that steps its optimizer inside backward; arguments as ``Trainer``, plus one.

    Args:
        *args, **kwargs: as for ``transformers.Trainer``. The optimizer comes from ``args.optim`` (any
            ``torch.optim`` class it names, such as the default ``adamw_torch_fused``), from
            ``optimizer_cls_and_kwargs`` (a ``torch.optim`` class or an :func:`dist_optim.in_backward` class), or
            from ``optimizers=(an InBackwardOptimizer, scheduler)``.
        in_backward_options: engine options of :class:`~dist_optim.InBackwardOptimizer` (``bucket_cap_mb``, ...)
            for the optimizer this trainer builds. ``track_grad_norm`` defaults to ``True``, since the Trainer logs
            ``grad_norm`` at every logging step. Clipping and accumulation come from ``TrainingArguments``.

    What the ``TrainingArguments`` do:
        - ``gradient_accumulation_steps``: the micro-batches the Trainer does not sync on (``sync_gradients`` is
          ``False``) run under ``opt.no_step()``; the window's last backward steps, also for a short last window.
        - ``max_grad_norm > 0``: ``opt.configure_clipping(max_grad_norm=..., clip_mode="exact")`` before training
          (the Trainer's own ``clip_grad_norm_`` call then finds no gradients and changes nothing); ``0`` or
          ``None``: no clipping. ``in_backward_options={"clip_mode": "two_pass"}`` (or an optimizer built with
          it) keeps the memory saving for the time of one more backward: the Trainer's accelerator then runs the
          optimizer's two backwards (:class:`~dist_optim.integrations.hf_accelerate.InBackwardAccelerator`'s).
        - the logged ``grad_norm``: ``opt.grad_norm`` (left out of the logs when the optimizer does not measure it),
          combined in ``model.parameters()`` order (``grad_norm_order``) as the Trainer's ``clip_grad_norm_``
          combines it, so that norm and clipping are bitwise the Trainer's.
        - memory: ``gradient_accumulation_steps > 1`` and ``max_grad_norm > 0`` without ``two_pass`` hold every
          gradient of the step, so nothing is saved; said once when the optimizer is created, in these terms.

    Raises:
        NotImplementedError: ``args.optim`` or ``optimizer_cls_and_kwargs`` gives something other than an optimizer
            class built as ``cls(params, **kwargs)`` (a ``functools.partial``, GaLore, LOMO, layer-wise
            optimizers, Muon/Dion factories), or ``fp16=True`` (its ``GradScaler``
            unscales after backward; use ``bf16=True``).
    """

    def __init__(self, *args: Any, in_backward_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._in_backward_options = {"track_grad_norm": True, **(in_backward_options or {})}
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            raise NotImplementedError(
                "TrainingArguments(fp16=True) with InBackwardTrainer: the Trainer's GradScaler unscales the "
                "gradients after backward, where they are already stepped. Use bf16=True, or a standard Trainer"
            )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
            kwargs = dict(kwargs)
            if not (isinstance(cls, type) and issubclass(cls, InBackwardOptimizer)):
                takes_model = {"params", "model", "optimizer_dict"} & set(kwargs)
                if takes_model or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                    source = ("optimizer_cls_and_kwargs" if self.optimizer_cls_and_kwargs is not None
                              else f"TrainingArguments(optim={str(self.args.optim)!r})")
                    raise NotImplementedError(
                        f"{source} gives {cls!r}"
                        f"{' from ' + ', '.join(sorted(takes_model)) if takes_model else ''}, which cannot be "
                        "stepped in backward by InBackwardTrainer: it needs a torch.optim.Optimizer class built as "
                        "cls(params, **kwargs). Choose one (optim='adamw_torch_fused', 'adamw_torch', 'sgd', "
                        "'adagrad'), or pass optimizer_cls_and_kwargs=(torch.optim.X, {...}) or "
                        "(dist_optim.in_backward(torch.optim.X, ...), {...})"
                    )
                cls = in_backward(cls, **self._in_backward_options)
            saved = self.optimizer_cls_and_kwargs
            self.optimizer_cls_and_kwargs = (cls, kwargs)
            try:
                super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = saved
        opt = unwrap(self.optimizer)
        if opt is not None:
            opt._saving.speak_as("InBackwardTrainer", HF_TERMS, self.args.gradient_accumulation_steps)
            # the Trainer measures (and clips) clip_grad_norm_(model.parameters()): its order, not the groups'
            opt.configure_clipping(**clipping_options(self.args.max_grad_norm, "norm", opt),
                                   grad_norm_order=(self.model if model is None else model).parameters())
            if opt.clip_mode == "two_pass" and not isinstance(self.accelerator, InBackwardAccelerator):
                # The Trainer's own Accelerator runs loss.backward(), one backward; InBackwardAccelerator's runs the
                # optimizer's two. It joins the Trainer's accelerator class (its state is the Trainer's), before
                # the Trainer prepares the optimizer through it.
                base = type(self.accelerator)
                self.accelerator.__class__ = type(f"InBackward{base.__name__}", (InBackwardAccelerator, base), {})
                self.accelerator._in_backward = []
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        opt = unwrap(self.optimizer)
        if opt is None or self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with opt.no_step():
            return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        opt = unwrap(self.optimizer)
        if opt is not None and "grad_norm" in logs:
            # the Trainer's clip_grad_norm_ found no gradients after the in-backward step and returned 0
            norm = opt.grad_norm
            if norm is None:
                del logs["grad_norm"]
            else:
                logs["grad_norm"] = norm.item()
        super().log(logs, start_time)

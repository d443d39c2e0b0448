"""``InBackwardAccelerator``: an ``accelerate.Accelerator`` whose ``accumulate()`` and clipping calls drive the
``InBackwardOptimizer`` it prepared: backwards that do not sync only accumulate, and ``clip_grad_norm_`` /
``clip_grad_value_`` return what the optimizer did inside backward, or raise when it did something else.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from dist_optim._frameworks import register_adapter
from dist_optim.integrations._common import (
    accumulating,
    check_norm_clip,
    check_value_clip,
    owner_of,
    unwrap,
)
from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["InBackwardAccelerator"]

# what cancels the memory saving, in the Accelerator's terms (dist_optim/engine/_saving.py has the engine's)
ACCELERATE_TERMS = {
    "accumulation": (
        "Accelerator(gradient_accumulation_steps={n}) (every gradient stays in .grad across the {n} micro-batches)",
        "gradient_accumulation_steps=1 and a DataLoader batch {n}x larger, with activation checkpointing",
    ),
}


@register_adapter
class InBackwardAccelerator(Accelerator):
    """An ``Accelerator`` for ``InBackwardOptimizer`` s passed to :meth:`prepare`; arguments as ``Accelerator``.

    - ``accelerator.backward(loss)`` while ``accelerator.sync_gradients`` is ``False`` (inside ``accumulate()``
      before the window's last micro-batch, including a short last window at the end of the data loader) only
      accumulates: the window's last backward steps on the sum, where ``optimizer.step()`` would.
    - ``clip_grad_norm_(params, max_norm)`` returns the norm the optimizer measured inside backward. The clipping
      itself must already be set on the optimizer (``max_grad_norm=max_norm``, ``clip_mode="exact"``), since the
      step ran before this call; otherwise it raises, naming the fix. ``max_norm=inf`` only measures (it needs
      ``track_grad_norm=True`` or a ``max_grad_norm``).
    - ``clip_grad_value_(params, clip_value)`` checks the optimizer's ``max_grad_value`` in the same way.
    - ``backward(loss)`` with an optimizer built with ``clip_mode="two_pass"``: the window's last backward is the
      optimizer's two (:meth:`~dist_optim.InBackwardOptimizer.backward`): exact clipping with the memory saving,
      for the time of one more backward; ``clip_mode="exact"`` holds the gradients instead, in one backward.
    - ``prepare(model, opt)`` with one model: the optimizer combines the global norm in ``model.parameters()``
      order (``grad_norm_order``, unless it was given one), as ``clip_grad_norm_(model.parameters(), ...)`` would,
      so that norm and clipping are bitwise the standard loop's.

    Parameters that no prepared ``InBackwardOptimizer`` steps go through ``Accelerator`` unchanged.

    Example:
        >>> import torch, dist_optim
        >>> from dist_optim.integrations.hf_accelerate import InBackwardAccelerator
        >>> accelerator = InBackwardAccelerator(cpu=True, gradient_accumulation_steps=2)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
        >>> model, opt = accelerator.prepare(model, opt)
        >>> for x in torch.randn(4, 2, 4):
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(model(x).square().mean())  # steps on every 2nd micro-batch
        ...         if accelerator.sync_gradients:
        ...             norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the real pre-clip norm
        ...         opt.step()
        ...         opt.zero_grad()
        >>> bool(norm > 0)
        True
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_backward: list[InBackwardOptimizer] = []

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        for obj in args:
            opt = unwrap(obj)
            if opt is not None and all(opt is not o for o in self._in_backward):
                self._in_backward.append(opt)
                opt._saving.speak_as("InBackwardAccelerator", ACCELERATE_TERMS, self.gradient_accumulation_steps)
                opt._saving.check(opt.options, opt.grad_bytes)
        models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
        if len(models) == 1:
            # a loop clips clip_grad_norm_(model.parameters()): the norm combines in that order, not the groups'
            for opt in filter(None, map(unwrap, args)):
                if opt.grad_norm_order is None:
                    opt.configure_clipping(grad_norm_order=models[0].parameters())
        return super().prepare(*args, **kwargs)

    @property
    def in_backward_optimizers(self) -> tuple[InBackwardOptimizer, ...]:
        """The ``InBackwardOptimizer`` s passed to :meth:`prepare`."""
        return tuple(self._in_backward)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if not self._in_backward:
            return super().backward(loss, **kwargs)
        if not self.sync_gradients:
            with accumulating(self._in_backward):
                return super().backward(loss, **kwargs)
        two_pass = [opt for opt in self._in_backward if opt.clip_mode == "two_pass" and opt.max_grad_norm is not None]
        if not two_pass:
            return super().backward(loss, **kwargs)
        if len(self._in_backward) > 1 or self.distributed_type in ("DEEPSPEED", "MEGATRON_LM"):
            raise NotImplementedError(
                f"clip_mode='two_pass' with {len(self._in_backward)} prepared in-backward optimizers under "
                f"{self.distributed_type}: its two backwards run through one optimizer's backward(); prepare one "
                "InBackwardOptimizer (param groups may differ), without DeepSpeed or Megatron-LM"
            )
        # what Accelerator.backward does before loss.backward(): the mean over the window, the scaler's scale
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        two_pass[0].backward(loss, **kwargs)
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        opt = owner_of(parameters, self._in_backward)
        if opt is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self._check_synced("clip_grad_norm_")
        return check_norm_clip(opt, max_norm, norm_type, "accelerator.clip_grad_norm_")

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        parameters = list(parameters)
        opt = owner_of(parameters, self._in_backward)
        if opt is None:
            return super().clip_grad_value_(parameters, clip_value)
        self._check_synced("clip_grad_value_")
        check_value_clip(opt, clip_value, "accelerator.clip_grad_value_")
        return None

    def _check_synced(self, caller: str) -> None:
        if not self.sync_gradients:
            raise RuntimeError(
                f"accelerator.{caller}() was called on a micro-batch that only accumulates (sync_gradients is "
                "False): the InBackwardOptimizer clips the window's summed gradients when it steps. Call it under "
                "`if accelerator.sync_gradients:`"
            )

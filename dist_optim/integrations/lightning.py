"""``InBackwardCallback``: Lightning's ``Trainer`` settings drive an ``InBackwardOptimizer`` returned by
``configure_optimizers``: ``accumulate_grad_batches`` (with Lightning's own rule for the epoch's last batch) decides
which backwards only accumulate, ``gradient_clip_val``/``gradient_clip_algorithm`` become the optimizer's exact
clipping, and the gradient norm of each step is logged.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from dist_optim._frameworks import register_adapter
from dist_optim.integrations._common import accumulating, clipping_options, unwrap
from dist_optim.optimizer import InBackwardOptimizer

__all__ = ["InBackwardCallback", "TwoPassBackward"]

# what cancels the memory saving, in the Trainer's terms (dist_optim/engine/_saving.py has the engine's)
LIGHTNING_TERMS = {
    "accumulation": (
        "Trainer(accumulate_grad_batches={n}) (every gradient stays in .grad across the {n} batches)",
        "accumulate_grad_batches=1 and a DataLoader batch {n}x larger, with activation checkpointing in the module",
    ),
    "exact_clip": (
        "Trainer(gradient_clip_val={n}) with an optimizer built with clip_mode='exact' (the global norm needs "
        "every gradient before the first step)",
        "InBackwardOptimizer(..., clip_mode='two_pass') and the module derived from "
        "dist_optim.integrations.lightning.TwoPassBackward (one more backward)",
    ),
}


@register_adapter
class InBackwardCallback(Callback):
    """Add to ``Trainer(callbacks=[...])`` when ``configure_optimizers`` returns an ``InBackwardOptimizer``.

    - ``accumulate_grad_batches=N``: the batches where Lightning would not step (it steps on every N-th batch of
      an epoch and on its last one) run their backward under ``opt.no_step()``, so the in-backward step comes on
      the same batches as Lightning's ``optimizer.step()``.
    - ``gradient_clip_val=v``: ``opt.configure_clipping(max_grad_norm=v, clip_mode="exact")`` (``"two_pass"``
      if the optimizer was built with it, which keeps the memory saving for the time of one more backward: the
      module then derives from :class:`TwoPassBackward`), or
      ``max_grad_value=v`` with ``gradient_clip_algorithm="value"``, set when fitting starts. While fitting,
      ``trainer.gradient_clip_val`` reads ``None``, since Lightning's own clipping would come after the step and find
      no gradients; it is put back when fitting ends.
    - ``accumulate_grad_batches > 1`` and an exact ``gradient_clip_val`` hold every gradient of the step (no memory
      saving): said once when fitting starts, in these terms.
    - ``log_grad_norm``: the name under which the global gradient norm of each step, before clipping, is logged
      (``None``: not logged). With a standard optimizer it is computed from the gradients, so a run with either
      optimizer logs the same figure. ``lightning.pytorch.utilities.grad_norm`` finds no gradients after an
      in-backward step; this is the norm to log instead (the optimizer measures it when ``track_grad_norm=True`` or
      a norm clip is set).

    Args:
        log_grad_norm: the metric's name, or ``None``.
        norm_type: the norm logged for a standard optimizer (an in-backward one logs its ``grad_norm_type``).

    Raises:
        NotImplementedError: a ``gradient_clip_algorithm`` other than ``"norm"``/``"value"``.
    """

    def __init__(self, log_grad_norm: str | None = "grad_norm", norm_type: float = 2.0) -> None:
        self.log_grad_norm = log_grad_norm
        self.norm_type = float(norm_type)
        self._stack = contextlib.ExitStack()
        self._clip_val: Any = None
        self._warned = False

    def _in_backward(self, trainer: Trainer) -> list[InBackwardOptimizer]:
        return [opt for opt in map(unwrap, trainer.optimizers) if opt is not None]

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        opts = self._in_backward(trainer)
        if not opts:
            return
        algorithm = trainer.gradient_clip_algorithm
        algorithm = "norm" if algorithm is None else str(getattr(algorithm, "value", algorithm))
        for opt in opts:
            opt._saving.speak_as("InBackwardCallback", LIGHTNING_TERMS, trainer.accumulate_grad_batches)
            opt.configure_clipping(**clipping_options(trainer.gradient_clip_val, algorithm, opt))
        if any(opt.clip_mode == "two_pass" and opt.max_grad_norm is not None for opt in opts) and not isinstance(
                pl_module, TwoPassBackward):
            raise NotImplementedError(
                f"an InBackwardOptimizer with clip_mode='two_pass' needs its two backwards, which Lightning runs as "
                f"one (LightningModule.backward): derive {type(pl_module).__name__} from "
                "dist_optim.integrations.lightning.TwoPassBackward, or build the optimizer with clip_mode='exact'"
            )
        if trainer.gradient_clip_val:
            self._clip_val, trainer.gradient_clip_val = trainer.gradient_clip_val, None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stack.close()
        self._restore(trainer)

    def _restore(self, trainer: Trainer) -> None:
        if self._clip_val is not None:
            trainer.gradient_clip_val, self._clip_val = self._clip_val, None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._stack.close()
        opts = self._in_backward(trainer)
        if opts and not _steps_on_this_batch(trainer):
            self._stack.enter_context(accumulating(opts))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stack.close()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.log_grad_norm is None:
            return
        opt = unwrap(optimizer)
        if opt is not None:
            norm = opt.grad_norm
            if norm is None and not self._warned:
                self._warned = True
                warnings.warn(
                    f"InBackwardCallback(log_grad_norm={self.log_grad_norm!r}) logs nothing: the InBackwardOptimizer "
                    "does not measure the gradient norm. Build it with track_grad_norm=True (or a max_grad_norm), "
                    "or pass log_grad_norm=None",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, self.norm_type) if grads else None
        if norm is not None:
            pl_module.log(self.log_grad_norm, norm, on_step=True, on_epoch=False)


def _steps_on_this_batch(trainer: Trainer) -> bool:
    """Lightning's rule (``_should_accumulate``): step on every ``accumulate_grad_batches``-th batch of the epoch
    and on its last batch. Read before the batch runs: the fetcher already knows whether it is the last."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    return (
        ready % trainer.accumulate_grad_batches == 0
        or ready == trainer.num_training_batches
        or progress.is_last_batch
    )


class TwoPassBackward:
    """A mixin for a ``LightningModule`` whose ``InBackwardOptimizer`` clips with ``clip_mode="two_pass"``:
    Lightning's backward (``LightningModule.backward``) becomes the optimizer's two
    (:meth:`~dist_optim.InBackwardOptimizer.backward`), on the loss Lightning hands over (already scaled by its
    precision plugin). Other optimizers backward as usual.

    Example:
        >>> import lightning.pytorch as pl
        >>> from dist_optim.integrations.lightning import TwoPassBackward
        >>> class Module(TwoPassBackward, pl.LightningModule):  # TwoPassBackward first: its backward wins
        ...     pass
    """

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        opts = [opt for opt in map(unwrap, self.trainer.optimizers)
                if opt is not None and opt.clip_mode == "two_pass" and opt.max_grad_norm is not None]
        if not opts:
            return super().backward(loss, *args, **kwargs)  # type: ignore[misc]
        if len(opts) > 1:
            raise NotImplementedError(
                f"{len(opts)} optimizers with clip_mode='two_pass': their backwards would run each other's "
                "steps; use one InBackwardOptimizer (its param groups may differ)"
            )
        opts[0].backward(loss)
        return None

"""The facade's options and telemetry: :class:`OptionsAndTelemetry`, a base of ``InBackwardOptimizer``.

Read-only views of the :class:`~dist_optim.InBackwardOptions` an optimizer runs with and of its last step, and the
two changes allowed between steps (``configure_clipping``, ``set_grad_multiplier``), each a checked copy of the
options handed to the training step. Kept apart from ``optimizer.py`` so that the ``torch.optim.Optimizer``
surface reads on its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from dist_optim import _torch_internals as internals
from dist_optim.engine._buckets import OUTSIDE_BACKWARD
from dist_optim.engine._grad_policy import StepStats
from dist_optim.engine._inputs import norm_order_of
from dist_optim.engine._options import InBackwardOptions, check_for_params

if TYPE_CHECKING:
    from dist_optim._training_step import TrainingStep
    from dist_optim.engine._engine import Engine
    from dist_optim.engine._stepper import Recipe

__all__: list[str] = []

_UNCHANGED: Any = object()  # an option configure_clipping leaves as it is


class OptionsAndTelemetry:
    """What ``InBackwardOptimizer`` shows of its options and last step; the attributes below are the facade's."""

    _edges: TrainingStep
    _engine: Engine
    _recipe: Recipe
    _norm_order: dict[int, int]  # id(tensor) -> its place in grad_norm_order
    param_groups: list[dict[str, Any]]

    def _rank_norms(self) -> None:
        """Give the policy each stepped tensor's place in ``grad_norm_order`` (by the engine's index)."""
        index = self._engine.index_of
        self._edges.policy.norm_rank = {index[k]: place for k, place in self._norm_order.items() if k in index}

    @property
    def step_incomplete(self) -> bool:
        """Whether a training step is half-applied: ``True`` from the first bucket stepped in a backward until
        that backward's end completes, and still ``True`` after a backward that raised (or was interrupted) in
        between, when some tensors were stepped on the batch and others not. Read-only."""
        return self._engine.incomplete

    @property
    def micro_batches(self) -> int:
        """Backwards accumulated since the last step (``0`` right after a step)."""
        return self._edges.micro_batches

    @property
    def last_step(self) -> StepStats:
        """Telemetry of the last training step: grad norm, tensors stepped and skipped, overflow, step time."""
        return self._edges.policy.stats

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Total norm of the gradients of the last step, measured inside backward before any step or clipping
        (the value ``clip_grad_norm_`` would have returned); ``None`` unless ``track_grad_norm=True`` or a
        global-norm ``max_grad_norm`` is set."""
        return self._edges.policy.stats.grad_norm

    @property
    def buckets(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The buckets formed so far, each the tuple of its parameters (read-only). Buckets are learned during the
        first backward that steps, in the order gradients arrive; under DDP they are DDP's buckets."""
        engine = self._engine
        return tuple(tuple(b.params) for b in (*engine.buckets, *engine.comm_buckets.values()))

    @property
    def optimizer_classes(self) -> tuple[type[torch.optim.Optimizer], ...]:
        """The optimizer class that steps each param group (``optimizer_class`` unless the group carried its own
        ``"optimizer_class"``), in ``param_groups`` order; checkpoints record it."""
        return tuple(self._recipe.classes)

    @property
    def optimizer_kwargs(self) -> tuple[dict[str, Any], ...]:
        """The constructor options each param group's class is built with besides the group's own keys (the
        ``**optimizer_kwargs`` given for ``optimizer_class``; ``{}`` for a group with its own class, which takes
        that class's defaults), in ``param_groups`` order (read-only copies). Checkpoints read options a class
        keeps on the instance (torchao's ``block_size``)."""
        return tuple(dict(self._recipe.kwargs_for(cls)) for cls in self._recipe.classes)

    @property
    def kernels(self) -> tuple[dict[str, bool], ...]:
        """The kernel flag chosen for each param group that left both ``fused`` and ``foreach`` unset
        (``{"fused": True}`` or ``{"foreach": True}``; ``{}``: the group's own flags, or the class's default), in
        ``param_groups`` order (read-only copies)."""
        return tuple(dict(k) for k in self._recipe.kernels)

    @property
    def options(self) -> InBackwardOptions:
        """The engine options this optimizer runs with (read-only; :meth:`configure_clipping` and
        :meth:`set_grad_multiplier` replace it with a changed copy)."""
        return self._edges.options

    @property
    def accumulation_steps(self) -> int:
        """The configured ``accumulation_steps``: backwards per in-backward step."""
        return self._edges.options.accumulation_steps

    @property
    def max_grad_norm(self) -> float | None:
        """The configured ``max_grad_norm`` (``None``: no norm clipping); see :meth:`configure_clipping`."""
        return self._edges.options.max_grad_norm

    @property
    def clip_mode(self) -> str:
        """The configured ``clip_mode``: ``"exact"``, ``"two_pass"``, ``"per_parameter"`` or ``"previous_norm"``."""
        return self._edges.options.clip_mode

    @property
    def grad_norm_order(self) -> tuple[torch.Tensor, ...] | None:
        """This optimizer's tensors in the order the global norm combines their norms, when ``grad_norm_order`` was
        given (``None``: the order they were given in); see :meth:`configure_clipping`."""
        if not self._norm_order:
            return None
        tensors = [p for g in self.param_groups for p in g["params"]]
        last = len(self._norm_order)
        return tuple(sorted(tensors, key=lambda p: self._norm_order.get(id(p), last)))

    @property
    def max_grad_value(self) -> float | None:
        """The configured ``max_grad_value`` (``None``: no value clipping)."""
        return self._edges.options.max_grad_value

    @property
    def grad_norm_type(self) -> float:
        """The configured ``grad_norm_type``."""
        return self._edges.options.grad_norm_type

    def configure_clipping(
        self,
        *,
        max_grad_norm: float | None | object = _UNCHANGED,
        clip_mode: str | object = _UNCHANGED,
        max_grad_value: float | None | object = _UNCHANGED,
        grad_norm_type: float | object = _UNCHANGED,
        grad_norm_order: Any = _UNCHANGED,
    ) -> InBackwardOptions:
        """Change the clipping options between two steps, as if they had been given at construction (a framework
        adapter sets them from the framework's own setting). Options not given keep their value; the previous
        step's norm is kept. ``grad_norm_order=None`` goes back to the order the tensors were given in. Nothing
        changes when an option is refused.

        Returns:
            The new :attr:`options`.

        Raises:
            ValueError: an option is out of range (as at construction).
            TypeError: ``grad_norm_order`` is not an ordered iterable of tensors or a module.
            RuntimeError: called during a backward.
        """
        if internals.graph_task_id() != OUTSIDE_BACKWARD:
            raise RuntimeError("configure_clipping() was called during a backward; call it between two steps")
        changes = {
            k: v for k, v in (("max_grad_norm", max_grad_norm), ("clip_mode", clip_mode),
                              ("max_grad_value", max_grad_value), ("grad_norm_type", grad_norm_type))
            if v is not _UNCHANGED
        }
        options = dataclasses.replace(self._edges.options, **changes)
        check_for_params(options, [p for g in self.param_groups for p in g["params"]])
        order = self._norm_order if grad_norm_order is _UNCHANGED else norm_order_of(grad_norm_order)
        self._edges.reconfigure(options)
        self._norm_order = order
        self._rank_norms()
        return options

    def set_grad_multiplier(self, multiplier: float | torch.Tensor | None) -> None:
        """Multiply every gradient by ``multiplier`` before it is checked, clipped and stepped, from the next step
        on until set again (``None``: no scaling). It is what a loop that sums ``loss * num_tokens`` and then
        scales the gradients by ``1 / num_tokens`` before clipping does (torchtune's recipes); set it any time
        before the backward that steps, e.g. once the window's token count is known.

        Raises:
            ValueError: ``multiplier`` is not a finite number or a one-element floating tensor.
            RuntimeError: called during a backward.
        """
        if internals.graph_task_id() != OUTSIDE_BACKWARD:
            raise RuntimeError("set_grad_multiplier() was called during a backward; call it between two steps")
        edges = self._edges
        edges.options = dataclasses.replace(edges.options, grad_multiplier=multiplier)
        edges.policy.grad_multiplier = edges.options.grad_multiplier

    @property
    def grad_multiplier(self) -> float | torch.Tensor | None:
        """The multiplier set by :meth:`set_grad_multiplier` (``None``: none)."""
        return self._edges.options.grad_multiplier


"""``InBackwardOptions``: the engine's options as one frozen object, checked once, where it is built.

``InBackwardOptimizer`` builds one from its keyword arguments (or takes one as ``options=``); the gradient policy,
the training step's edges and the cross-rank fingerprint all read this object, and a change between steps
(``configure_clipping``, ``set_grad_multiplier``) makes a checked copy with ``dataclasses.replace``, as DCP's
``StateDictOptions`` is one object checked once.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from dist_optim.engine._inputs import is_dtensor

__all__ = ["InBackwardOptions"]

DEFAULT_BUCKET_CAP_MB = 4.0
CLIP_MODES = ("exact", "two_pass", "per_parameter", "previous_norm")
OVERFLOW_MODES = ("exact", "per_bucket")
NONFINITE_MODES = ("ignore", "skip", "raise")
RANDOM_DRAW_MODES = ("exact", "reordered")


@dataclass(frozen=True)
class InBackwardOptions:
    """Every engine option of :class:`~dist_optim.InBackwardOptimizer`, each a keyword of it, documented here.

    Read it from ``opt.options``; give one as ``InBackwardOptimizer(params, cls, options=...)`` in place of the
    keywords (to share one set of options between optimizers); change it with ``dataclasses.replace`` (the copy is
    checked again). ``grad_divisor`` is the one option without a keyword: ``dist_optim.pipeline_optimizers`` sets it
    to the schedule's number of micro-batches, whose mean the schedule takes by dividing each gradient (``x / n``,
    which differs from ``x * (1 / n)`` in the last bit).

    Attributes:
        bucket_cap_mb: gradient bytes, in MiB, that a bucket holds at most before it is stepped. The gradients one
            autograd node computes together (a Linear's weight and bias) share a bucket even over the cap, since
            they are alive together anyway (a single larger tensor forms a bucket with them alone); under FSDP2 a
            bucket never spans two ``fully_shard`` units. Default: 4, whatever the size of the model: the peak in
            backward is the activations alive when it starts plus at most one bucket, and a cap below the model's
            tensors costs a step each for little memory (measured in docs/benchmarks.md, "The default bucket
            cap"). ``float("inf")``: one bucket, stepped when backward ends (no memory saving; under FSDP2 one
            per unit).
        per_parameter: step each parameter on its own as soon as its gradient is ready (least memory, slowest).
        allow_local_steps: in a multi-rank job, step plain tensors on their local, un-reduced gradients (local
            SGD). Without it such a job is refused.
        accumulation_steps: step on every ``accumulation_steps``-th backward only; the backwards between
            accumulate into ``.grad`` (scale the losses yourself, as in the standard loop). See also
            :meth:`no_step`; :meth:`step` steps whatever has accumulated (e.g. at the end of an epoch).
        max_grad_norm: clip gradients by norm before stepping, in the way ``clip_mode`` says.
        clip_mode: ``"exact"``: ``clip_grad_norm_`` semantics on the global norm; the gradients of the whole
            step are held until backward ends (no memory saving, the norms are still measured as buckets complete).
            ``"two_pass"``: the same result, keeping the memory saving, for the time of one more backward: call
            :meth:`backward` in place of ``loss.backward()``; it measures the global norm in a first backward over
            the retained graph (each gradient measured and freed), then clips and steps each bucket in a second.
            ``"per_parameter"``: each tensor clipped by its own norm, stepped at once. ``"previous_norm"``: each
            bucket clipped with the global norm of the previous step (no clipping on the first step).
        grad_norm_type: the norm's type, as for ``clip_grad_norm_``.
        max_grad_value: clamp every gradient element to ``[-max_grad_value, max_grad_value]``
            (``clip_grad_value_``), after any norm clipping.
        track_grad_norm: measure the global gradient norm every step (:attr:`grad_norm`), at the cost of one read
            of the gradients; always on when a global-norm clipping mode is set.
        grad_scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` produced the backward: gradients are
            unscaled inside backward and checked; ``scaler.update()`` then works as usual.
        overflow: with ``grad_scaler``: ``"exact"`` holds the step's gradients until backward ends and steps all
            or nothing, like ``scaler.step``; ``"per_bucket"`` skips only the buckets that overflow (earlier
            buckets keep their step) and keeps the memory saving.
        nonfinite: without a scaler: ``"ignore"`` (the standard loop's behaviour), ``"skip"`` (buckets with a
            non-finite gradient are not stepped, counted in :attr:`last_step`; the whole step when gradients are
            held) or ``"raise"`` (``FloatingPointError`` naming the parameters).
        strict: raise instead of warning when a loop runs several stepping backwards between two :meth:`step`
            calls (gradient accumulation written for a standard optimizer, which steps here on every backward).
        random_draws: ``"exact"`` (default) refuses a class whose tensors' steps draw random numbers from the
            global streams (torchao's ``bf16_stochastic_round=True``), since stepping bucket by bucket gives each
            tensor other draws than the standard loop's. ``"reordered"`` accepts such a class when its probes show
            that this is the only difference: stepped one tensor at a time in the standard loop's order it is its
            standard step bitwise, and in backward's order it draws the same numbers, the generator ending where
            the standard loop's does. The parameters then differ from the standard loop's as two runs from
            different seeds do (docs/optimizers.md). One process and DDP (without ``find_unused_parameters``,
            ``static_graph`` or ignored parameters, so that every rank steps its tensors in one order) only.

    Raises:
        ValueError: an option is out of range or of the wrong kind; the message names it and what it accepts.
        TypeError: ``grad_scaler`` is not a ``torch.amp.GradScaler``.

    Example:
        >>> import dataclasses, dist_optim
        >>> options = dist_optim.InBackwardOptions(max_grad_norm=1.0, clip_mode="two_pass")
        >>> options.clips_by_global_norm, dataclasses.replace(options, clip_mode="per_parameter").clips_by_global_norm
        (True, False)
        >>> dist_optim.InBackwardOptions(clip_mode="global")
        Traceback (most recent call last):
          ...
        ValueError: clip_mode must be one of 'exact', 'two_pass', 'per_parameter', 'previous_norm', got 'global'
    """

    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    per_parameter: bool = False
    allow_local_steps: bool = False
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    clip_mode: str = "exact"
    grad_norm_type: float = 2.0
    max_grad_value: float | None = None
    track_grad_norm: bool = False
    grad_scaler: torch.amp.GradScaler | None = field(default=None, compare=False)
    overflow: str = "exact"
    nonfinite: str = "ignore"
    strict: bool = False
    random_draws: str = "exact"
    grad_multiplier: float | torch.Tensor | None = field(default=None, compare=False)
    grad_divisor: int | None = None

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"bucket_cap_mb must be > 0, got {cap!r}")
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 1):
            raise ValueError(f"accumulation_steps must be an int >= 1, got {steps!r}")
        for name in ("max_grad_norm", "max_grad_value"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0)):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        for name, allowed in (("clip_mode", CLIP_MODES), ("overflow", OVERFLOW_MODES),
                              ("nonfinite", NONFINITE_MODES), ("random_draws", RANDOM_DRAW_MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        try:
            norm_type = float(self.grad_norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"grad_norm_type must be a number > 0 (or inf), got {self.grad_norm_type!r}") from None
        if not norm_type > 0:
            raise ValueError(f"grad_norm_type must be > 0 (or inf), got {self.grad_norm_type!r}")
        object.__setattr__(self, "grad_norm_type", norm_type)
        scaler = self.grad_scaler
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scaler is not None and self.nonfinite != "ignore":
            raise ValueError("with a grad_scaler, overflows are the scaler's business: leave nonfinite='ignore'")
        object.__setattr__(self, "grad_multiplier", _checked_multiplier(self.grad_multiplier))
        divisor = self.grad_divisor
        if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1):
            raise ValueError(f"grad_divisor must be an int >= 1 or None, got {divisor!r}")

    # -- what the options imply ---------------------------------------------------------------------------------
    @property
    def cap_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes (``sys.maxsize`` for ``inf``: one bucket)."""
        return sys.maxsize if math.isinf(self.bucket_cap_mb) else int(self.bucket_cap_mb * 2**20)

    @property
    def clips_by_global_norm(self) -> bool:
        """Whether the gradients are clipped by the global norm of the step (every mode but ``per_parameter``)."""
        return self.max_grad_norm is not None and self.clip_mode != "per_parameter"

    @property
    def measures_norms(self) -> bool:
        """Whether gradient norms are taken at all (tracked, clipped by, or checked for non-finite values)."""
        return self.track_grad_norm or self.max_grad_norm is not None or self.nonfinite != "ignore"


def engine_keywords() -> tuple[str, ...]:
    """The options that are keyword arguments of ``InBackwardOptimizer`` (all but ``grad_divisor``, which only
    ``pipeline_optimizers`` sets, and ``grad_multiplier``, set with ``set_grad_multiplier``)."""
    return tuple(f.name for f in fields(InBackwardOptions) if f.name not in ("grad_divisor", "grad_multiplier"))


def _checked_multiplier(value: Any) -> float | torch.Tensor | None:
    """A gradient multiplier is a finite number or a one-element floating tensor (``None``: no scaling)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"grad_multiplier must be a number or a one-element floating tensor, got a {value.dtype} tensor of "
                f"shape {tuple(value.shape)}"
            )
        return value.detach()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"grad_multiplier must be a finite number, a one-element tensor or None, got {value!r}")
    return float(value)


def check_for_params(options: InBackwardOptions, params: list[torch.Tensor]) -> None:
    """The options checked against the tensors they will step (at construction, for each added group, and when
    the clipping changes), before anything steps:

    - gradient norms over DTensors and plain tensors together (plain norms next to a tensor-parallel model, with
      ``allow_local_steps``) fail in DTensor's foreach norm, as ``clip_grad_norm_`` does on them;
    - ``max_grad_value`` clamps each gradient in place, which DTensor refuses on a ``Partial`` gradient (a
      SequenceParallel norm's, under tensor parallel without FSDP2), as ``clip_grad_value_`` fails on it in the
      standard loop: refused for every replicated DTensor parameter (whose gradient may be Partial; only the
      backward would tell).
    """
    if options.measures_norms and params and len({is_dtensor(p) for p in params}) > 1:
        raise NotImplementedError(
            "gradient norms (max_grad_norm, track_grad_norm or nonfinite checks) over plain tensors next to DTensor "
            "ones (plain parameters in a tensor-parallel model, stepped with allow_local_steps=True): DTensor's norm "
            "refuses the mix, as torch.nn.utils.clip_grad_norm_ does. Parallelize those parameters too "
            "(SequenceParallel for norms) so that every parameter is a DTensor"
        )
    if options.max_grad_value is None:
        return
    replicated = [p for p in params if is_dtensor(p) and all(pl.is_replicate() for pl in p.placements)
                  and p.device_mesh.size() > 1]
    if replicated:
        raise NotImplementedError(
            f"max_grad_value with {len(replicated)} replicated DTensor parameters (tensor parallel without FSDP2): "
            "a SequenceParallel norm's gradient is Partial, which DTensor cannot clamp in place "
            "(torch.nn.utils.clip_grad_value_ fails on it too), and which ones are is known only in the middle of a "
            "backward. Use max_grad_norm, or shard with fully_shard on top of tensor parallel (FSDP2 reduces those "
            "gradients before the step)"
        )


def options_from(options: InBackwardOptions | None, keywords: dict[str, Any]) -> InBackwardOptions:
    """The engine options: ``options`` itself, or built (and checked) from the keywords; not both."""
    if options is None:
        return InBackwardOptions(**keywords)
    if not isinstance(options, InBackwardOptions):
        raise TypeError(f"options must be a dist_optim.InBackwardOptions, got {type(options).__name__}")
    defaults = InBackwardOptions()
    given = [k for k in engine_keywords() if k in keywords and keywords[k] is not getattr(defaults, k)
             and keywords[k] != getattr(defaults, k)]
    if given:
        raise ValueError(
            f"InBackwardOptimizer got options= and the engine keyword(s) {', '.join(given)}: give each option once, "
            f"in options (dataclasses.replace(options, {given[0]}=...)) or as a keyword"
        )
    return options

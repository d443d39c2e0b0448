"""What happens to a bucket's gradients between backward and the step: divide, unscale, multiply, measure, check, clip.

One ``GradPolicy`` per optimizer. The engine hands it each completed bucket (``prepare``), which divides by the
step's gradient divisor (a pipeline schedule's ``n`` micro-batches), unscales (a ``GradScaler``), applies its
multiplier (a framework's ``1 / num_tokens`` scaling), then the rest, in the standard loops' order; where the
decision needs every gradient of the step (exact global-norm clipping, all-or-nothing fp16 overflow), the engine
holds the buckets and asks ``finish_held`` at the end of backward. Clipping calls torch's own helpers
(``clip_grads_with_norm_``, ``clip_grad_value_``) and the rest follows torch's arithmetic (``clip_grad_norm_``'s
norms, ``GradScaler.unscale_``), so results match the standard loop.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dist_optim._torch_internals import (
    amp_unscale_,
    foreach_norm,
    group_tensors_by_device_and_dtype,
    is_fake,
    mark_unscaled,
    scaler_scale,
)
from dist_optim.engine._inputs import is_dtensor
from dist_optim.engine._options import InBackwardOptions

__all__: list[str] = []



@dataclass
class StepStats:
    """Telemetry of the last training step, read from ``InBackwardOptimizer.last_step``.

    Attributes:
        grad_norm: total norm of all gradients before any step or clipping (a 0-d tensor), as
            ``torch.nn.utils.clip_grad_norm_`` returns it; ``None`` when not tracked.
        clip_coef: the factor the gradients were multiplied by (global-norm modes), ``None`` if none applied.
        params_stepped: tensors stepped.
        params_skipped: tensors whose gradients were present but not stepped (non-finite, fp16 overflow).
        overflow: whether a non-finite gradient was found (GradScaler overflow or ``nonfinite`` check).
        step_time_s: host time spent in the optimizer's steps and gradient transforms (launch time on GPUs).
        grad_bytes_peak: the most gradient bytes alive at once during the backward that stepped (arrived and not
            yet freed, counted by the engine; under DDP, bucket by bucket once reduced); with a model compiled
            whole, every gradient, since its compiled backward hands them over together. ``0`` after a standard
            :meth:`step`.
    """

    grad_norm: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None
    params_stepped: int = 0
    params_skipped: int = 0
    overflow: bool = False
    step_time_s: float = 0.0
    grad_bytes_peak: int = 0


class GradPolicy:
    """One optimizer's gradient transforms, from its :class:`InBackwardOptions`: per bucket (:meth:`prepare`),
    per held step (:meth:`finish_held`), per two-pass measurement (:meth:`finish_measure`), and the step's telemetry
    (:attr:`stats`) and the norm the next step may clip by (``previous_norm``). Each backward that steps or
    measures starts with :meth:`begin`, each training step ends with :meth:`end` (telemetry, the GradScaler's
    record); :attr:`phase` says which pass of a two-pass step runs."""

    def __init__(self, options: InBackwardOptions) -> None:
        max_grad_norm, clip_mode = options.max_grad_norm, options.clip_mode
        self.max_grad_norm = max_grad_norm
        self.clip_mode = clip_mode
        self.norm_type = options.grad_norm_type
        self.max_grad_value = options.max_grad_value
        scaler = options.grad_scaler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.overflow_mode = options.overflow
        self.nonfinite = options.nonfinite
        self.track_norm = options.track_grad_norm or options.clips_by_global_norm
        self.grad_multiplier = options.grad_multiplier
        self.grad_divisor = options.grad_divisor
        # two_pass: a measuring backward decides norm and overflow, then the stepping backward steps each bucket
        self.two_pass = max_grad_norm is not None and clip_mode == "two_pass"
        self._holds = (max_grad_norm is not None and clip_mode == "exact") or (
            self.scaler is not None and options.overflow == "exact" and not self.two_pass
        )
        self.hold = self._holds  # for this step: whether buckets wait for the decision on the whole step
        # The pass of a two-pass step, set by the optimizer around each backward: "" (a plain backward), "measure",
        # "step", or "held" (gradients accumulated before: held as exact clipping holds them, in one backward).
        self.phase = ""
        self.measured_norm: torch.Tensor | None = None  # the measuring pass's global norm, which the step clips by
        self._coef: torch.Tensor | None = None
        self._transforms = self.track_norm or self.hold or self.scaler is not None or max_grad_norm is not None or (
            options.max_grad_value is not None or options.nonfinite != "ignore"
        )
        self.previous_norm: torch.Tensor | None = None
        self.stats = StepStats()
        # parameter index -> its place in the order the global norm combines the per-tensor norms (the order
        # clip_grad_norm_ is given the tensors in); indices absent follow, in index order
        self.norm_rank: dict[int, int] = {}
        self._norms: dict[int, torch.Tensor] = {}
        self._found_inf: torch.Tensor | None = None
        self._inv_scale: torch.Tensor | None = None
        self._started = 0.0

    @property
    def active(self) -> bool:
        """Whether a bucket's gradients go through :meth:`prepare` at all (else they are stepped as they are)."""
        return self._transforms or self.grad_multiplier is not None or self.grad_divisor is not None

    # -- per training step --------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A backward that steps (or measures) begins."""
        self.hold = self._holds or self.phase == "held" or (self.two_pass and self.phase == "")
        measuring_time = self.stats.step_time_s if self.phase == "step" else 0.0
        if self.phase != "step":
            self.measured_norm = self._coef = None
        self.stats = StepStats(step_time_s=measuring_time)
        self._norms.clear()
        self._found_inf = None
        if self.scaler is not None:
            scale = scaler_scale(self.scaler)  # set by scaler.scale(loss), which ran before this backward
            if scale is None:
                raise RuntimeError("grad_scaler is set but scaler.scale(loss) was not used for this backward")
            self._inv_scale = scale.double().reciprocal().float()
            self._found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)

    def prepare(self, indices: list[int], params: list[torch.Tensor], describe, divide: bool = True) -> bool:
        """Transform one bucket's gradients in place, in the standard loops' order: divide by the step's divisor
        (``divide``: not gradients the schedule has divided already), unscale and check for inf/NaN (a
        ``GradScaler``), multiply by the multiplier, measure each tensor's norm (for the global norm, the
        ``nonfinite`` check or per-parameter clipping), check for non-finite gradients (``nonfinite``: raise or
        skip), then clip (by norm per parameter, by the previous step's or the measured norm, then by value) unless
        the bucket is held for the whole step's decision or this is a measuring pass. Returns ``False`` if the
        bucket must not be stepped (an overflow with ``overflow="per_bucket"``, a non-finite gradient with
        ``nonfinite="skip"``); raises ``FloatingPointError`` for a non-finite gradient with ``nonfinite="raise"``."""
        t0 = time.perf_counter()
        grads = [p.grad for p in params]
        ok = True
        if self.grad_divisor is not None and divide:
            # grad.div_(n), the pipeline schedule's own mean: x * (1 / n) differs from x / n in the last bit. First,
            # as there: the schedule divides when its step ends, before scaler.step(opt) unscales.
            for g in grads:
                g.div_(self.grad_divisor)
        if self.scaler is not None:
            found = torch.zeros_like(self._found_inf)
            for device_grads, inv in _by_device(grads, self._inv_scale):
                amp_unscale_(device_grads, found, inv)
            self._found_inf.add_(found)  # the scaler only needs "any"
            if self.overflow_mode == "per_bucket" and found.item():
                ok = False
        if self.grad_multiplier is not None:
            _mul(grads, self.grad_multiplier)
        norms = None
        if self.track_norm or self.nonfinite != "ignore" or (self.max_grad_norm and self.clip_mode == "per_parameter"):
            norms = per_tensor_norms(grads, self.norm_type)
            if self.track_norm:
                for i, n in zip(indices, norms):
                    self._norms[i] = n
        if self.nonfinite != "ignore":
            finite = torch.stack([n.to(norms[0].device) for n in norms]).isfinite()
            if not bool(finite.all()):
                self.stats.overflow = True
                if self.nonfinite == "raise":
                    bad = [describe(k) for k, f in enumerate(finite.tolist()) if not f]
                    raise FloatingPointError(
                        f"non-finite gradient for parameter(s) {', '.join(bad)} (nonfinite='raise'); use "
                        "nonfinite='skip' to skip such steps and count them"
                    )
                ok = False
        if ok and not self.hold and self.phase != "measure":
            self._clip_now(params, norms)
        self.stats.step_time_s += time.perf_counter() - t0
        return ok

    def _clip_now(self, params: list[torch.Tensor], norms: list[torch.Tensor] | None) -> None:
        # torch's own helpers, as the standard loop calls them: the same kernels (foreach where torch uses it)
        if self.max_grad_norm is not None:
            if self.clip_mode == "per_parameter":
                for p, n in zip(params, norms):
                    # clip_grad_norm_([p], max_norm): the global norm of one tensor's norm
                    total = torch.linalg.vector_norm(torch.stack([n]), self.norm_type)
                    torch.nn.utils.clip_grads_with_norm_([p], self.max_grad_norm, total)
            elif self.clip_mode == "previous_norm" and self.previous_norm is not None:
                self.stats.clip_coef = self._clip_coef(self.previous_norm)
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, self.previous_norm)
            elif self._coef is not None:  # two_pass, the stepping pass
                self.stats.clip_coef = self._coef
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, self.measured_norm)
        if self.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.max_grad_value)

    def finish_held(self, params: list[torch.Tensor]) -> bool:
        """For held buckets: decide the whole step, and clip every held gradient by the global norm."""
        t0 = time.perf_counter()
        if self.scaler is not None and self._found_inf.item():
            self.stats.step_time_s += time.perf_counter() - t0
            return False
        if self.max_grad_norm is not None and self.clip_mode in ("exact", "two_pass"):
            norm = self.total_norm()
            self.stats.clip_coef = self._clip_coef(norm)
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        if self.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.max_grad_value)
        self.stats.step_time_s += time.perf_counter() - t0
        return True

    def finish_measure(self) -> bool:
        """The measuring pass of a two-pass step is over: take the global norm and the clipping coefficient the
        stepping pass applies. ``False``: the step is skipped (a GradScaler overflow, or a non-finite gradient with
        ``nonfinite="skip"``), and no stepping pass is needed."""
        if (self.scaler is not None and self._found_inf.item()) or self.stats.overflow:
            return False
        self.measured_norm = self.total_norm()
        self._coef = self._clip_coef(self.measured_norm)
        return True

    def _clip_coef(self, norm: torch.Tensor) -> torch.Tensor:
        """The factor ``clip_grads_with_norm_(params, max_grad_norm, norm)`` multiplies by (for the telemetry)."""
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def total_norm(self) -> torch.Tensor:
        """The global norm of the measured tensors, combined as ``clip_grad_norm_`` combines them: in the order of
        :attr:`norm_rank`, grouped by device and dtype as torch groups them, stacked on the first one's device."""
        if not self._norms:
            return torch.tensor(0.0)
        last = len(self.norm_rank)
        order = sorted(self._norms, key=lambda i: (self.norm_rank.get(i, last), i))
        norms = [self._norms[i] for i in order]
        first = norms[0].device
        grouped = group_tensors_by_device_and_dtype([norms], with_indices=True)
        combined = [norms[k] for _, (_, positions) in grouped.items() for k in positions]
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in combined]), self.norm_type)

    # -- what a checkpoint must carry ----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Plain data that the next step depends on beyond the optimizer's state: the previous step's norm, in
        ``previous_norm`` mode (a collective when the norm is a DTensor: call it on every rank)."""
        if self.clip_mode != "previous_norm" or self.max_grad_norm is None or self.previous_norm is None:
            return {}
        norm = self.previous_norm
        full = norm.full_tensor() if is_dtensor(norm) else norm
        return {"previous_grad_norm": full.item(), "dtype": str(full.dtype).removeprefix("torch.")}

    def load_extra_state(self, state: dict[str, Any], like: torch.Tensor) -> None:
        """Restore :meth:`extra_state`; the norm is rebuilt on ``like``'s device (replicated on its mesh for a
        DTensor), which gives the value, and so the clipping coefficient, of the run that saved it."""
        value = state.get("previous_grad_norm")
        if value is None:
            self.previous_norm = None
            return
        dtype = getattr(torch, str(state.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"previous_grad_norm dtype {state.get('dtype')!r} is not a torch dtype")
        if is_dtensor(like):
            from torch.distributed.tensor import DTensor, Replicate

            local = torch.tensor(value, dtype=dtype, device=like.to_local().device)
            mesh = like.device_mesh
            self.previous_norm = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
        else:
            self.previous_norm = torch.tensor(value, dtype=dtype, device=like.device)

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        if self.track_norm:
            norm = self.total_norm()
            if self.measured_norm is not None and self.phase == "step":
                if not is_fake(norm) and not torch.equal(norm, self.measured_norm):
                    warnings.warn(
                        f"the two backwards of clip_mode='two_pass' computed different gradients (global norm "
                        f"{self.measured_norm.item()!r} measured, {norm.item()!r} stepped on): some kernel of the "
                        "model is not deterministic (on CUDA: atomics in index_add, scatter, some convolutions). The "
                        "step clipped with the measured norm. torch.use_deterministic_algorithms(True) makes both "
                        "passes equal, or use clip_mode='exact'",
                        UserWarning,
                        stacklevel=2,
                    )
                norm = self.measured_norm
            self.stats.grad_norm = norm
            self.previous_norm = norm
        if self.scaler is not None:
            self.stats.overflow = bool(self._found_inf.item())
            _record_for_scaler(self.scaler, optimizer, self._found_inf)


def per_tensor_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's norm by the kernel ``clip_grad_norm_`` uses for it: ``_foreach_norm`` over the tensors of one
    device and dtype (on CUDA a list of mixed dtypes would take another kernel)."""
    first = grads[0]
    if all(g.device == first.device and g.dtype == first.dtype for g in grads):
        return list(foreach_norm(grads, norm_type))
    norms: list[torch.Tensor | None] = [None] * len(grads)
    for ([kind], positions) in group_tensors_by_device_and_dtype([grads], with_indices=True).values():
        for k, n in zip(positions, foreach_norm(kind, norm_type)):
            norms[k] = n
    return norms  # type: ignore[return-value]


def _by_device(grads: list[torch.Tensor], inv_scale: torch.Tensor):
    devices: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        devices.setdefault(g.device, []).append(g)
    for device, device_grads in devices.items():
        yield _reducing_first(device_grads), inv_scale.to(device)


def _reducing_first(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` with one that is not ``Replicate`` on the most mesh dimensions first. On DTensor gradients the
    unscale kernel takes ``found_inf``'s max over the mesh dimensions on which the list's *first* gradient is not
    ``Replicate`` (DTensor's ``found_inf_reduce_handler``): a bucket led by a replicated tensor (a RowwiseParallel
    bias, beside its Shard(1) weight) would keep an overflow in one rank's shard on that rank alone, which then
    skips while the others step (and wait in the next collective). The order changes no unscaled value."""
    if not grads or not is_dtensor(grads[0]):
        return grads
    lead = max(range(len(grads)), key=lambda k: sum(not pl.is_replicate() for pl in grads[k].placements))
    return grads if lead == 0 else [grads[lead], *grads[:lead], *grads[lead + 1:]]


def _mul(grads: list[torch.Tensor], coef: torch.Tensor | float) -> None:
    # a framework's multiplier (torchtune's scale_grads: ``p.grad *= scaler``), tensor by tensor as there
    for g in grads:
        g.mul_(coef.to(g.device) if isinstance(coef, torch.Tensor) else coef)


def _record_for_scaler(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Leave the scaler as ``scaler.unscale_(optimizer)`` would: ``scaler.update()`` backs off or grows from this
    step's overflow, and a loop that still calls ``scaler.step(optimizer)`` keeps working. GradScaler has no public
    way to report an inf check made elsewhere, hence its per-optimizer record."""
    mark_unscaled(scaler, optimizer, found_inf)


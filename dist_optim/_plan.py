"""Will it fit? The memory of one training step, planned on fake tensors, for the standard loop and in backward.

:func:`plan` builds the model under ``FakeTensorMode`` (no real memory), runs a first step to create the optimizer
state, then traces the storages of a second, warm step: the peak, split into parameters, optimizer state, gradients,
activations and other, for ``loss.backward(); opt.step(); opt.zero_grad()`` and for ``InBackwardOptimizer``.
``python -m dist_optim.plan`` does it from the command line (a Hugging Face ``config.json``, or a builder by name).
One process only so far. ``dist_optim/plan.py`` is the command line's entry point; this module is the planner.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__: list[str] = []

MiB = 2**20
LOOPS = ("standard", "in_backward")
CATEGORIES = ("parameters", "optimizer_state", "gradients", "activations", "other")
CLIP_MODES = ("exact", "two_pass", "per_parameter", "previous_norm")
# What a trace of operators' outputs cannot see, said in the output and docs/planning.md
NOT_SEEN = (
    "memory no operator returns: kernels' workspaces (cuBLAS, cuDNN, MKL), the CUDA caching allocator's "
    "rounding and fragmentation, gloo/NCCL buffers, the CUDA context",
)


@dataclass
class LoopPlan:
    """One loop's planned memory through the warm step (bytes, this process)."""

    loop: str  # "standard" or "in_backward"
    peak_bytes: int  # the most bytes alive at once during the step
    start_bytes: int  # alive when the step starts: parameters, optimizer state, buffers, the batch
    breakdown: dict[str, int]  # the peak split by CATEGORIES (sums to peak_bytes)
    peak_phase: str  # the part of the step the peak falls in: forward, backward, step
    kernel: str  # the optimizer kernel the step ran: fused, foreach or for-loop
    timeline: list[tuple[int, str, int]] = field(default_factory=list, repr=False)  # (event, phase, bytes alive)

    @property
    def step_peak_bytes(self) -> int:
        """The peak above the step's start: what ``launch.memory_peak.allocator_peak`` measures of a step."""
        return self.peak_bytes - self.start_bytes


@dataclass
class MemoryPlan:
    """Both loops' planned memory for one configuration (bytes, this process). ``saving_bytes`` is the standard
    peak minus the in-backward one."""

    standard: LoopPlan
    in_backward: LoopPlan
    n_params: int  # parameters this process holds
    options: dict[str, Any]  # the engine's and the batch's options, as planned
    not_seen: tuple[str, ...] = NOT_SEEN

    @property
    def saving_bytes(self) -> int:
        return self.standard.peak_bytes - self.in_backward.peak_bytes

    def loops(self) -> tuple[LoopPlan, LoopPlan]:
        return self.standard, self.in_backward

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The plan as JSON-ready values (``timeline=True`` adds both loops' timelines)."""
        out: dict[str, Any] = {"n_params": self.n_params, "options": self.options,
                               "saving_bytes": self.saving_bytes, "not_seen": list(self.not_seen)}
        for lp in self.loops():
            out[lp.loop] = {"peak_bytes": lp.peak_bytes, "start_bytes": lp.start_bytes,
                            "step_peak_bytes": lp.step_peak_bytes, "breakdown": lp.breakdown,
                            "bytes_per_param": lp.peak_bytes / max(1, self.n_params),
                            "peak_phase": lp.peak_phase, "kernel": lp.kernel,
                            **({"timeline": lp.timeline} if timeline else {})}
        return out

    def table(self) -> str:
        """Both loops side by side, in MiB, with the saving and what the plan does not see."""
        rows = [("", "standard", "in backward")]
        rows.append(("peak (MiB)", *(f"{lp.peak_bytes / MiB:.1f}" for lp in self.loops())))
        for c in CATEGORIES:
            rows.append((f"  {c.replace('_', ' ')}", *(f"{lp.breakdown[c] / MiB:.1f}" for lp in self.loops())))
        rows.append(("bytes / parameter", *(f"{lp.peak_bytes / max(1, self.n_params):.2f}" for lp in self.loops())))
        rows.append(("peak during", *(lp.peak_phase for lp in self.loops())))
        rows.append(("optimizer kernel", *(lp.kernel for lp in self.loops())))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[0].ljust(width[0]) if i == 0 else r[i].rjust(width[i]) for i in range(3)) for r in rows]
        saving = self.saving_bytes
        pct = 100 * saving / self.standard.peak_bytes if self.standard.peak_bytes else 0.0
        lines.append(f"saving: {saving / MiB:.1f} MiB ({pct:.1f} % of the standard peak), {self.n_params:,} "
                     "parameters, one process")
        lines += [f"not seen: {why}" for why in self.not_seen]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG of both loops' bytes alive through the warm step (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for lp in self.loops():
            n = max(1, lp.timeline[-1][0])
            ax.plot([e / n for e, _, _ in lp.timeline], [b / MiB for _, _, b in lp.timeline],
                    label=f"{lp.loop.replace('_', ' ')}: peak {lp.peak_bytes / MiB:.1f} MiB", lw=1)
        ax.set_xlabel("progress through the warm step (allocation events)")
        ax.set_ylabel("MiB alive (planned)")
        ax.set_title(f"planned memory, one step; saving {self.saving_bytes / MiB:.1f} MiB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


# -- the step, the same for planning and for measuring --------------------------------------------------------------
def _default_kernel(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The standard loop's kernel where the caller chose none: fused where the class has it (not SGD, as the
    in-backward engine), else foreach: the same kernel on both sides."""
    if kwargs.get("fused") is not None or kwargs.get("foreach") is not None:
        return {}
    names = inspect.signature(cls.__init__).parameters
    if "fused" in names and not issubclass(cls, torch.optim.SGD):
        return {"fused": True}
    return {"foreach": True} if "foreach" in names else {}


class Job:
    """A model, its optimizer in one loop (``"standard"`` or ``"in_backward"``) and one optimizer step over
    micro-batches: what :func:`plan` traces on fake tensors and a validation runs for real."""

    def __init__(self, model: nn.Module, loop: str, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                 engine_options: dict[str, Any], before_optimizer: Callable[[nn.Module], None] | None = None
                 ) -> None:
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        self.model, self.loop, self.loss_fn = model, loop, loss_fn
        self.max_grad_norm = engine_options.get("max_grad_norm")
        self.clip_mode = engine_options.get("clip_mode", "exact")
        self.accumulation_steps = engine_options.get("accumulation_steps", 1)
        self.track_grad_norm = engine_options.get("track_grad_norm", False)
        self.autocast: torch.dtype | None = None  # the forward's autocast dtype, if any
        if before_optimizer is not None:
            before_optimizer(model)
        if loop == "in_backward":
            from dist_optim.optimizer import InBackwardOptimizer

            self.opt: torch.optim.Optimizer = InBackwardOptimizer(model, optimizer_class, **engine_options,
                                                                  **optimizer_kwargs)
            kernels = self.opt.kernels
            groups = self.opt.param_groups
            self.kernel = ("fused" if any(k.get("fused") or g.get("fused") for k, g in zip(kernels, groups)) else
                           "foreach" if any(k.get("foreach") or g.get("foreach") for k, g in zip(kernels, groups))
                           else "for-loop")
        else:
            kw = {**_default_kernel(optimizer_class, optimizer_kwargs), **optimizer_kwargs}
            self.opt = optimizer_class([p for p in model.parameters() if p.requires_grad], **kw)
            self.kernel = "fused" if kw.get("fused") else "foreach" if kw.get("foreach") else "for-loop"
        self._previous_norm: torch.Tensor | None = None
        self.phase: Callable[[str], None] = lambda name: None  # told where the step is (the planner's trace)

    def step(self, batches: Sequence[Any]) -> None:
        """One optimizer step over ``batches`` (its micro-batches, ``accumulation_steps`` of them)."""
        for batch in batches:
            self.phase("forward")
            if self.autocast is None:
                loss = self.loss_fn(self.model, batch) / len(batches)
            else:
                device = next(self.model.parameters()).device.type
                with torch.autocast(device, dtype=self.autocast):
                    loss = self.loss_fn(self.model, batch) / len(batches)
            self.phase("backward")
            if self.loop == "in_backward":
                self.opt.backward(loss)
            else:
                loss.backward()
            del loss
        if self.loop == "standard":
            self.phase("step")
            self._clip()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _clip(self) -> None:
        """The standard loop's counterpart of each clip mode (as launch/train_loop.py clips)."""
        c, mode = self.max_grad_norm, self.clip_mode
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = None
        if self.track_grad_norm or (c is not None and mode != "per_parameter"):
            norm = nn.utils.get_total_norm([p.grad for p in params])
        if c is not None:
            if mode in ("exact", "two_pass"):
                nn.utils.clip_grads_with_norm_(params, c, norm)
            elif mode == "per_parameter":
                for p in params:
                    nn.utils.clip_grad_norm_([p], c)
            elif self._previous_norm is not None:
                nn.utils.clip_grads_with_norm_(params, c, self._previous_norm)
        self._previous_norm = norm

    def resident(self) -> list[torch.Tensor]:
        """The tensors alive between steps: parameters, buffers, gradients left over, optimizer state."""
        out = [*self.model.parameters(), *self.model.buffers()]
        out += [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in self.opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if self._previous_norm is not None:
            out.append(self._previous_norm)
        return out


# -- planning -------------------------------------------------------------------------------------------------------
def _trace_loop(loop: str, model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Any],
                loss_fn: Callable[[nn.Module, Any], torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                optimizer_kwargs: dict[str, Any], engine_options: dict[str, Any],
                autocast_dtype: torch.dtype | None) -> tuple[LoopPlan, int]:
    from dist_optim._memory_trace import MemoryTrace
    from dist_optim._torch_internals import FakeTensorMode, tree_leaves

    micro = engine_options.get("accumulation_steps", 1)
    with FakeTensorMode(), warnings.catch_warnings():
        # the engine compares gradients' storage addresses, which fake tensors do not have (0, and a warning):
        # only FSDP2's shared reduce-scatter buffers depend on it
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model = model_fn()
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trace = MemoryTrace()

        def watch_grads(m: nn.Module) -> None:
            # registered before the optimizer's own hooks, so the gradient is seen before the engine frees it
            def seen(p: torch.Tensor) -> None:
                block = trace.block_of(p.grad)
                if block is not None:
                    block.is_grad = True
            for p in m.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(seen)

        job = Job(model, loop, loss_fn, optimizer_class, optimizer_kwargs, engine_options, watch_grads)
        job.autocast = autocast_dtype
        job.step([batch_fn() for _ in range(micro)])  # the first step creates the optimizer state
        batches = [batch_fn() for _ in range(micro)]

        def phase(name: str) -> None:
            trace.phase = name
        job.phase = phase
        with trace:
            trace.seed(job.resident() + [t for t in tree_leaves(batches) if isinstance(t, torch.Tensor)])
            start = trace.total
            trace.phase = "forward"
            job.step(batches)
            trace.finish()
        # ids of blocks alive now (and so unique): the parameters' and the optimizer state's
        params = {id(trace.block_of(t)) for t in [*model.parameters(), *model.buffers()]} - {id(None)}
        state = {id(trace.block_of(v)) for s in job.opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)} - {id(None)}
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for block, nbytes in trace.peak_blocks:
            key = id(block)
            category = ("parameters" if key in params else "optimizer_state" if key in state else
                        "gradients" if block.is_grad else "activations" if block.phase == "forward" else "other")
            breakdown[category] += nbytes
        assert sum(breakdown.values()) == trace.peak, (breakdown, trace.peak)
        return LoopPlan(loop, trace.peak, start, breakdown, trace.peak_phase, job.kernel, trace.timeline), n_params


def plan(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    bucket_cap_mb: float = 4.0,
    per_parameter: bool = False,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_mode: str = "exact",
    track_grad_norm: bool = False,
    autocast_dtype: torch.dtype | None = None,
    **optimizer_kwargs: Any,
) -> MemoryPlan:
    """Plan one warm training step's memory on this process, for the standard loop and in backward, without
    allocating the model.

    Both loops build the model with ``model_fn`` under ``FakeTensorMode`` (tensors with shapes and no data), run one
    step to create the optimizer state, then trace every storage of a second step: the standard loop is
    ``loss.backward()`` per micro-batch, the clipping ``clip_mode`` stands for (``clip_grad_norm_`` for
    ``"exact"`` and ``"two_pass"``), ``opt.step(); opt.zero_grad()``; in backward it is
    ``InBackwardOptimizer(model, optimizer_class, ...)`` and ``opt.backward(loss)``. Both use the same kernel:
    ``fused`` where the class has one, else ``foreach``, unless ``optimizer_kwargs`` choose.

    Args:
        model_fn: builds the model (called under ``FakeTensorMode``; it must not read real tensors).
        batch_fn: makes one micro-batch (called under ``FakeTensorMode``), e.g. ``lambda: (torch.randint(...),) * 2``.
        loss_fn: ``loss_fn(model, batch)``, the micro-batch's loss (the planner divides it by
            ``accumulation_steps``).
        optimizer_class: a ``torch.optim.Optimizer`` subclass.
        bucket_cap_mb, per_parameter, accumulation_steps, max_grad_norm, clip_mode, track_grad_norm: the
            engine's options (see ``InBackwardOptimizer``); the standard loop clips as ``clip_mode`` says.
        autocast_dtype: run the forward and the loss under ``torch.autocast`` with this dtype (mixed precision:
            the parameters, gradients and state keep theirs).
        **optimizer_kwargs: ``optimizer_class``'s options (``lr``, ...).

    Returns:
        A :class:`MemoryPlan`: each loop's peak, its split, the saving, bytes per parameter, both timelines.

    Raises:
        ValueError: an engine option is out of range (as ``InBackwardOptimizer`` raises it).

    Example:
        >>> import torch, dist_optim
        >>> p = dist_optim.plan(lambda: torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))),
        ...                     lambda: torch.randn(8, 512), lambda model, x: model(x).square().mean(),
        ...                     bucket_cap_mb=1, lr=1e-3)
        >>> [round(lp.breakdown["gradients"] / 2**20, 1) for lp in p.loops()]  # MiB at each loop's peak
        [4.0, 1.0]
        >>> p.saving_bytes > 2**20
        True
    """
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    engine = dict(bucket_cap_mb=bucket_cap_mb, per_parameter=per_parameter, accumulation_steps=accumulation_steps,
                  max_grad_norm=max_grad_norm, clip_mode=clip_mode, track_grad_norm=track_grad_norm)
    plans = {}
    for loop in LOOPS:
        plans[loop], n_params = _trace_loop(loop, model_fn, batch_fn, loss_fn, optimizer_class, optimizer_kwargs,
                                            engine, autocast_dtype)
    options = {**engine, "autocast_dtype": None if autocast_dtype is None else str(autocast_dtype).split(".")[-1],
               "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
               "optimizer_kwargs": {k: v for k, v in optimizer_kwargs.items() if isinstance(v, (int, float, str))}}
    return MemoryPlan(plans["standard"], plans["in_backward"], n_params, options)


# -- the command line -----------------------------------------------------------------------------------------------
def _class(path: str) -> Any:
    """``torch.optim.AdamW`` or ``package.module:name`` -> the object."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise ValueError(f"expected module.name or module:name, got {path!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _hf_model(config_path: str, dtype: torch.dtype, checkpointing: bool) -> tuple[Callable[[], nn.Module], int]:
    """A builder of a Hugging Face causal LM from its ``config.json`` (no weights read), and its vocabulary."""
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(f"--hf-config needs transformers: {e}") from e
    config = transformers.AutoConfig.from_pretrained(config_path)
    config.use_cache = False

    def build() -> nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if checkpointing:  # non-reentrant, as the engine needs (transformers 5 renamed the method)
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model
    return build, config.vocab_size


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def _logits_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dist_optim.plan",
        description="Plan one warm training step's memory, standard loop against in backward, on fake tensors "
                    "(nothing of the model's size is allocated). One process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder): "
                       "AutoModelForCausalLM.from_config, loss from labels")
    model.add_argument("--model", metavar="MODULE:CALLABLE", help="a builder of a model mapping token ids "
                       "(batch, seq) to logits (batch, seq, vocab), called with --model-kwargs, e.g. launch.gpt:GPT")
    p.add_argument("--model-kwargs", default="{}", metavar="JSON", help="--model's keyword arguments")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--model: token ids drawn below this (default: --model-kwargs' vocab_size)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="--hf-config: recompute each decoder layer in backward (gradient_checkpointing_enable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the parameters' dtype (the optimizer state follows it)")
    p.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                   help="the forward under torch.autocast with this dtype (mixed precision)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--optimizer", default="torch.optim.AdamW", help="the optimizer class, by name")
    p.add_argument("--lr", type=float, default=1e-3, help="the optimizer's lr (no effect on memory)")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0, help="the engine's bucket cap, MiB of gradients")
    p.add_argument("--per-parameter", action="store_true", help="step each parameter on its own in backward")
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per step, each --batch-size")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip to this global norm (both loops)")
    p.add_argument("--clip-mode", choices=CLIP_MODES, default="exact", help="how --max-grad-norm clips in backward")
    p.add_argument("--track-grad-norm", action="store_true", help="measure the global norm every step")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of both loops' memory timelines (needs matplotlib)")
    return p


def main(argv: Sequence[str] | None = None) -> MemoryPlan:
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.hf_config:
        model_fn, vocab = _hf_model(args.hf_config, dtype, args.activation_checkpointing)
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _hf_loss
    else:
        if args.activation_checkpointing:
            raise SystemExit("--activation-checkpointing: only with --hf-config (a --model checkpoints itself)")
        kwargs = json.loads(args.model_kwargs)
        builder = _class(args.model)
        vocab = args.vocab_size or kwargs.get("vocab_size")
        if not vocab:
            raise SystemExit("--model: give --vocab-size (or vocab_size in --model-kwargs)")

        def model_fn() -> nn.Module:
            # the default dtype, not .to(dtype): fake parameters cannot be swapped for converted ones
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                return builder(**kwargs)
            finally:
                torch.set_default_dtype(before)
        loss_fn = _logits_loss
    shape = (args.batch_size, args.seq_len)

    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)

    result = plan(model_fn, batch_fn, loss_fn, _class(args.optimizer), bucket_cap_mb=args.bucket_cap_mb,
                  per_parameter=args.per_parameter, accumulation_steps=args.accumulation_steps,
                  max_grad_norm=args.max_grad_norm, clip_mode=args.clip_mode,
                  track_grad_norm=args.track_grad_norm,
                  autocast_dtype=None if args.autocast is None else getattr(torch, args.autocast), lr=args.lr)
    result.options.update(batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                          activation_checkpointing=args.activation_checkpointing,
                          model=args.hf_config or args.model)
    if args.plot:
        result.plot(args.plot)
    sys.stdout.write((json.dumps(result.to_dict(), indent=2) if args.json else result.table()) + "\n")
    return result

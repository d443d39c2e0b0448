"""Whether a configuration keeps the memory saving, said once: the settings that hold every gradient of a step.

Stepping in backward saves memory only while gradients are freed as they arrive. Some settings hold them all until
backward ends (or across backwards); the optimizer warns once, naming each and what keeps the saving. A framework
adapter gives the same causes in its own terms (``speak_as``) before the optimizer learns its settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from dist_optim.engine._options import DEFAULT_BUCKET_CAP_MB, InBackwardOptions

__all__: list[str] = []

# cause -> (what the setting is, what keeps the saving), in the engine's own terms; {n} the value of the setting
ENGINE_TERMS: dict[str, tuple[str, str]] = {
    "accumulation": (
        "accumulation_steps={n} (every gradient stays in .grad across the {n} micro-batches)",
        "one backward per step: a micro-batch {n}x larger with activation checkpointing "
        "(torch.utils.checkpoint per block) instead of accumulation",
    ),
    "exact_clip": (
        "max_grad_norm={n} with clip_mode='exact' (the global norm needs every gradient before the first step)",
        "clip_mode='two_pass' (one more backward: call opt.backward(loss)), or 'per_parameter' / 'previous_norm'",
    ),
    "exact_overflow": (
        "a grad_scaler with overflow='exact' (all or nothing: every gradient is held until the overflow check)",
        "overflow='per_bucket' (only the buckets that overflow skip their step)",
    ),
    "held": (
        "every gradient was accumulated by the backwards before the one that steps (opt.no_step(), DDP's "
        "model.no_sync(), FSDP2's set_requires_gradient_sync(False))",
        "one backward per step: a larger micro-batch with activation checkpointing (torch.utils.checkpoint per "
        "block) instead of accumulation",
    ),
    "one_bucket": (
        "bucket_cap_mb={n} covers all the model's gradients: one bucket, stepped when backward ends",
        "a bucket_cap_mb below the model's gradient size (the default, 4, on a model over 4 MiB)",
    ),
}


# (who, terms, frames) of the optimizers built inside speaking_as: a builder whose own setting holds the gradients
_SPEAKER: contextvars.ContextVar[tuple[str, dict[str, tuple[str, str]], int] | None] = contextvars.ContextVar(
    "dist_optim_saving_speaker", default=None)


@contextlib.contextmanager
def speaking_as(who: str, terms: dict[str, tuple[str, str]], frames: int) -> Iterator[None]:
    """Optimizers built inside name the causes in ``who``'s ``terms`` from their construction on: for a builder
    that sets an engine option itself (``pipeline_optimizers`` sets ``accumulation_steps`` to the schedule's
    micro-batches), where ``speak_as`` after construction would come after the warning. ``frames``: the builder's
    own calls between the user's line and the optimizer's construction, which the warning points past."""
    token = _SPEAKER.set((who, terms, frames))
    try:
        yield
    finally:
        _SPEAKER.reset(token)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def causes_of(options: InBackwardOptions, model_bytes: int, accumulation: int | None = None) -> dict[str, object]:
    """The settings of ``options`` that hold every gradient, each with its value (``accumulation``: a framework's
    accumulation, in place of ``options.accumulation_steps``)."""
    causes: dict[str, object] = {}
    steps = options.accumulation_steps if accumulation is None else accumulation
    if steps > 1:
        causes["accumulation"] = steps
    if options.max_grad_norm is not None and options.clip_mode == "exact":
        causes["exact_clip"] = options.max_grad_norm
    if options.grad_scaler is not None and options.overflow == "exact":
        causes["exact_overflow"] = None
    explicit_cap = options.bucket_cap_mb != DEFAULT_BUCKET_CAP_MB  # the default over a tiny model: little to save
    if not options.per_parameter and explicit_cap and 0 < model_bytes <= options.cap_bytes:
        causes["one_bucket"] = options.bucket_cap_mb
    return causes


@dataclass
class SavingWatch:
    """One optimizer's record of the causes it warned about (each once) and the terms it speaks in."""

    terms: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(ENGINE_TERMS))
    who: str = "InBackwardOptimizer"
    warned: set[str] = field(default_factory=set)
    accumulation: int | None = None  # a framework's accumulation, in place of the option's
    frames: int = 0  # a builder's calls between the user's line and the optimizer's construction (speaking_as)

    def __post_init__(self) -> None:
        speaker = _SPEAKER.get()
        if speaker is not None:
            self.who, terms, self.frames = speaker
            self.terms = {**ENGINE_TERMS, **terms}

    def speak_as(self, who: str, terms: dict[str, tuple[str, str]], accumulation: int) -> None:
        """Name the causes in a framework's terms (its settings in place of the engine's options), its
        ``accumulation`` (micro-batches per step) in place of ``accumulation_steps``."""
        self.who, self.accumulation = who, accumulation
        self.terms = {**ENGINE_TERMS, **terms}

    def held_before_step(self, model_bytes: int) -> None:
        """Seen at the first backward that steps: every gradient was already in ``.grad`` (accumulated by hand).
        Not said again when the accumulation was named already (the option, a framework's setting)."""
        if "held" not in self.warned and "accumulation" not in self.warned:
            self._warn({"held": None}, model_bytes, stacklevel=6)

    def check(self, options: InBackwardOptions, model_bytes: int, stacklevel: int = 3) -> None:
        """Warn once about the causes of ``options`` not warned about before."""
        found = causes_of(options, model_bytes, self.accumulation)
        causes = {k: v for k, v in found.items() if k not in self.warned}
        frames, self.frames = self.frames, 0  # the builder's frames stand between the user and the first check only
        if causes:
            self._warn(causes, model_bytes, stacklevel + 1 + frames)

    def _warn(self, causes: dict[str, object], model_bytes: int, stacklevel: int) -> None:
        self.warned.update(causes)
        lines = [f"- {self.terms[k][0].format(n=v)}: keep it with {self.terms[k][1].format(n=v)}"
                 for k, v in causes.items()]
        warnings.warn(
            f"{self.who} holds every gradient of the step ({_size(model_bytes)} of the model's {_size(model_bytes)}), "
            "so stepping in backward saves no gradient memory, because of:\n" + "\n".join(lines)
            + "\nopt.last_step.grad_bytes_saved reports the saving of each step (docs/getting-started.md, "
            "'Settings that keep the saving')",
            UserWarning,
            stacklevel=stacklevel,
        )

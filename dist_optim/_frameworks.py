"""The optimizer swapped into a training framework without its adapter: HF ``Trainer``, ``accelerate``, Lightning and
torchtune recipes clip, scale and accumulate gradients *after* backward, where an in-backward step has already
consumed them. The framework object is found on the Python stack (only when its module is already imported) and
compared with the optimizer's own settings: a run that would differ from the framework's standard run is refused
before anything steps; one that differs only in the norm the framework logs is warned. The adapters of
``dist_optim.integrations`` register here and are left alone.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Callable

__all__: list[str] = []

_ADAPTERS: list[type] = []
_DOCS = "docs/frameworks.md, 'The swap alone'"


def register_adapter(cls: type) -> type:
    """Class decorator: ``cls`` (a framework subclass or a Lightning callback) configures the optimizer from the
    framework's own settings, so a framework object that is (or holds) one is not checked."""
    _ADAPTERS.append(cls)
    return cls


class Watch:
    """Where one optimizer looks for a framework, each point once:

    - at construction: the framework builds the optimizer (HF ``create_optimizer``, Lightning ``configure_optimizers``,
      a torchtune recipe's ``_setup_optimizer``); before anything steps, on every device.
    - at the start of the first backward that steps, before its first bucket: on CPU the hooks run on the thread
      that called ``backward()``, so the framework's frames are above them; this covers an optimizer built outside
      the framework (HF ``optimizers=(opt, ...)``, ``accelerator.prepare(opt)``). On CUDA the hooks run on
      autograd's device threads, whose stack holds no framework frame: nothing is seen there.
    - at the first ``step()`` call from the loop: what CUDA's device threads hid, but after the first in-backward step
      (except Lightning, whose ``step(closure)`` runs the backward inside it).
    """

    __slots__ = ("backward_seen", "step_seen", "warned")

    def __init__(self) -> None:
        self.backward_seen = False
        self.step_seen = False
        self.warned = False

    def at_construction(self, opt: Any) -> None:
        self._check(opt, "construction")

    # Marked seen only once passed: a refused run retried with the same optimizer is refused again.
    def at_backward(self, opt: Any) -> None:
        if self.backward_seen:
            return
        try:
            self._check(opt, "backward")
        except ValueError:
            # The refused backward's gradients (and the micro-batches before it) would be added to the next run's.
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
            raise
        self.backward_seen = True

    def at_step(self, opt: Any) -> None:
        if not self.step_seen:
            self._check(opt, "step")
            self.step_seen = True

    def _check(self, opt: Any, point: str) -> None:
        predicates = _loaded()
        if not predicates:
            return
        found = _find(sys._getframe(2), predicates)
        if not found or _adapted(found):
            return
        for kind, obj in found.items():
            if kind == "accelerate" and "hf" in found:
                continue  # the Trainer's own accelerator: the Trainer's settings say it all
            framework, adapter, wrong, logs = _RULES[kind](obj, opt, point)
            if wrong:
                when = (" (seen at the first step() call, after the in-backward step: on CUDA the hooks run on "
                        "autograd's device threads, where the framework is not visible)" if point == "step" else "")
                raise ValueError(
                    f"{type(opt).__name__} in {framework} without its adapter would train differently from "
                    f"{framework}'s standard run{when}: {'; '.join(wrong)}. Or use {adapter}, which takes these "
                    f"settings from {framework} ({_DOCS})"
                )
            if logs and not self.warned:
                self.warned = True
                warnings.warn(
                    f"{type(opt).__name__} in {framework} without its adapter: {'; '.join(logs)}. Or use {adapter}, "
                    f"which reports what the optimizer did in backward ({_DOCS})",
                    UserWarning,
                    stacklevel=4,
                )


def adapted_framework_above(frame: types.FrameType | None) -> bool:
    """Whether a framework object on the stack above ``frame`` has its adapter (a Lightning ``Trainer`` with
    ``InBackwardCallback``, whose ``optimizer.step(closure)`` runs the step's backward in the closure, to step in it)."""
    predicates = _loaded()
    found = _find(frame, predicates) if predicates else {}
    return bool(found) and _adapted(found)


def _loaded() -> dict[str, Callable[[Any], bool]]:
    """Each framework whose module is imported: how to recognise its object (no import, no cost otherwise)."""
    out: dict[str, Callable[[Any], bool]] = {}
    hf = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if isinstance(hf, type):
        out["hf"] = lambda obj: isinstance(obj, hf)
    trainers = tuple(t for t in (getattr(sys.modules.get(m), "Trainer", None) for m in (
        "lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")) if isinstance(t, type))
    if trainers:
        out["lightning"] = lambda obj: isinstance(obj, trainers)
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if isinstance(accelerator, type):
        out["accelerate"] = lambda obj: isinstance(obj, accelerator)
    recipe = getattr(sys.modules.get("torchtune.recipe_interfaces"), "FTRecipeInterface", None)
    if isinstance(recipe, type):
        # a Protocol that is not runtime-checkable: recipes name it as a base class
        out["torchtune"] = lambda obj: recipe in type(obj).__mro__
    return out


def _find(frame: types.FrameType | None, predicates: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    """The innermost object of each framework that is ``self`` of a frame on the stack."""
    found: dict[str, Any] = {}
    while frame is not None and len(found) < len(predicates):
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            for kind, recognise in predicates.items():
                if kind not in found and recognise(obj):
                    found[kind] = obj
        frame = frame.f_back
    return found


def _adapted(found: dict[str, Any]) -> bool:
    adapters = tuple(_ADAPTERS)
    for kind, obj in found.items():
        if isinstance(obj, adapters):
            return True
        if kind == "lightning" and any(isinstance(c, adapters) for c in obj.callbacks):
            return True
    return False


def _clipping(setting: str, off: str, clip: float, opt: Any) -> str:
    """The framework clips by norm after backward: never equal, even when ``opt`` clips alike in backward (its own
    clip finds no gradient and reports 0, and a short window that ``step()`` steps at the end of an epoch would be
    clipped twice)."""
    mirrored = opt.max_grad_norm == float(clip) and opt.clip_mode == "exact" and opt.grad_norm_type == 2.0
    return (
        f"{setting} clips the gradients after backward, where this optimizer has already stepped on them and freed "
        f"them (it has max_grad_norm={opt.max_grad_norm}): set {off} and "
        + ("keep the optimizer's clipping" if mirrored else f"give the optimizer max_grad_norm={clip}")
    )


def _accumulation(setting: str, k: int, opt: Any) -> list[str]:
    """``setting`` names the framework's accumulation, with ``{k}`` where its value goes."""
    if k <= 1 or opt.accumulation_steps == k:
        return []
    every = "every" if opt.accumulation_steps == 1 else f"every {opt.accumulation_steps}-th"
    return [f"{setting.format(k=k)} accumulates {k} micro-batches before each optimizer step, but this optimizer "
            f"steps on {every} backward (accumulation_steps={opt.accumulation_steps}): pass accumulation_steps={k} "
            "to the optimizer"]


Rule = Callable[[Any, Any, str], tuple[str, str, list[str], list[str]]]


def _hf(trainer: Any, opt: Any, point: str) -> tuple[str, str, list[str], list[str]]:
    """``transformers.Trainer``: its ``max_grad_norm``, its ``gradient_accumulation_steps``, and the ``grad_norm``
    it logs at every step (measured from ``.grad``, even with ``max_grad_norm=0``)."""
    args = trainer.args
    clip = args.max_grad_norm or 0.0
    wrong = [_clipping(f"TrainingArguments(max_grad_norm={clip})", "TrainingArguments(max_grad_norm=0)", clip, opt)
             ] if clip > 0 else []
    wrong += _accumulation("TrainingArguments(gradient_accumulation_steps={k})", args.gradient_accumulation_steps, opt)
    logs = ["the Trainer logs grad_norm measured from the gradients left after backward, which this optimizer has "
            "already freed: it will log 0.0"]
    return "transformers.Trainer", "dist_optim.integrations.hf_trainer.InBackwardTrainer", wrong, logs


def _lightning(trainer: Any, opt: Any, point: str) -> tuple[str, str, list[str], list[str]]:
    """Lightning's ``Trainer``: ``gradient_clip_val`` (by norm or value) and ``accumulate_grad_batches``."""
    clip = trainer.gradient_clip_val
    algorithm = trainer.gradient_clip_algorithm
    algorithm = "norm" if algorithm is None else str(getattr(algorithm, "value", algorithm))
    wrong = []
    if clip and algorithm == "value":
        wrong.append(
            f"Trainer(gradient_clip_val={clip}, gradient_clip_algorithm='value') clamps the gradients after "
            "backward, where this optimizer has already stepped on them and freed them (torch's clip_grad_value_ "
            f"then fails on the empty list): set gradient_clip_val=None and give the optimizer max_grad_value={clip}"
        )
    elif clip:
        wrong.append(_clipping(f"Trainer(gradient_clip_val={clip})", "gradient_clip_val=None", clip, opt))
    wrong += _accumulation("Trainer(accumulate_grad_batches={k})", trainer.accumulate_grad_batches, opt)
    return ("Lightning's Trainer", "dist_optim.integrations.lightning.InBackwardCallback in "
            "Trainer(callbacks=[...])", wrong, [])


def _loop_names(obj: Any) -> set[str]:
    """The names the code that called a method of ``obj`` refers to (the training loop around
    ``accelerator.backward(loss)``), read from the stack; empty if not found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_argcount and frame.f_code.co_varnames[0] == "self" and frame.f_locals.get("self") is obj:
            caller = frame.f_back
            return set(caller.f_code.co_names) if caller is not None else set()
        frame = frame.f_back
    return set()


def _accelerate(accelerator: Any, opt: Any, point: str) -> tuple[str, str, list[str], list[str]]:
    """``accelerate.Accelerator``: a backward it does not sync (``accumulate()``) must not step; clipping the loop
    calls after backward (accelerate has no clipping setting, so the loop's code is read for the calls)."""
    wrong, logs = [], []
    # Read from the loop's code, so a call in a branch that never runs is named too (the message says so): a call
    # that would fail inside torch or clip what the optimizer does not is refused before anything steps.
    loop = _loop_names(accelerator) if point == "backward" else set()
    read = ("(read from the loop's code: if the call is in a branch that never runs, the adapter checks it only "
            "when it runs)")
    if "clip_grad_value_" in loop:
        wrong.append(
            "the loop's code calls accelerator.clip_grad_value_, which runs after backward, where this optimizer has "
            "already stepped on the gradients and freed them: torch's clip_grad_value_ then fails on the empty "
            "gradient list ('Expected !nested_tensorlist[0].empty()'). Drop the call"
            + (f" (the optimizer's max_grad_value={opt.max_grad_value} clamps inside backward)"
               if opt.max_grad_value is not None else " and give the optimizer max_grad_value=<its clip_value>")
            + f" {read}"
        )
    if "clip_grad_norm_" in loop:
        if opt.max_grad_norm is None:
            wrong.append(
                "the loop's code calls accelerator.clip_grad_norm_, which runs after backward, where this optimizer "
                "has already stepped on unclipped gradients and freed them (it clips nothing and returns 0.0): give "
                f"the optimizer max_grad_norm=<its max_norm> and drop the call {read}"
            )
        else:
            logs.append(
                "the loop's code calls accelerator.clip_grad_norm_, which after backward finds no gradient, clips "
                "nothing and returns 0.0: the optimizer's max_grad_norm clips inside backward and opt.grad_norm is "
                "the norm"
            )
    if point == "backward" and not accelerator.sync_gradients:
        k = accelerator.gradient_accumulation_steps
        wrong.append(
            f"accelerator.accumulate() with Accelerator(gradient_accumulation_steps={k}) marks this micro-batch as "
            "one that only accumulates (accelerator.sync_gradients is False), but this optimizer steps in it "
            f"(accumulation_steps={opt.accumulation_steps}): pass accumulation_steps={k} to the optimizer"
        )
    return ("accelerate.Accelerator", "dist_optim.integrations.hf_accelerate.InBackwardAccelerator", wrong, logs)


def _torchtune(recipe: Any, opt: Any, point: str) -> tuple[str, str, list[str], list[str]]:
    """A torchtune recipe (``FTRecipeInterface``), by the attributes its recipes keep their settings in and the
    calls of its ``train`` loop: ``scale_grads``, ``clip_grad_norm_`` with ``clip_grad_norm``, and
    ``gradient_accumulation_steps``."""
    name = f"the torchtune recipe {type(recipe).__name__}"
    if getattr(recipe, "_optimizer_in_bwd", False):
        return name, "", [], []  # torchtune's own in-backward path: the recipe neither scales nor clips
    train = getattr(getattr(type(recipe), "train", None), "__code__", None)
    loop = set(train.co_names) if train is not None else set()  # what the recipe's training loop calls
    wrong = []
    # the multiplier is set before the window's last backward: not yet known at construction
    if "scale_grads" in loop and opt.grad_multiplier is None and point != "construction":
        wrong.append(
            f"{type(recipe).__name__}.train scales the gradients by 1 / num_tokens after backward "
            "(training.scale_grads), where this optimizer has already stepped on the unscaled ones: call "
            "opt.set_grad_multiplier(1 / num_tokens) before the backward of each window's last micro-batch"
        )
    clip = getattr(recipe, "_clip_grad_norm", None)
    if clip is not None and "clip_grad_norm_" in loop:
        wrong.append(_clipping(f"clip_grad_norm={clip}", "clip_grad_norm: null in the config", clip, opt))
    steps = getattr(recipe, "_gradient_accumulation_steps", 1)
    if isinstance(steps, int):
        wrong += _accumulation("gradient_accumulation_steps={k}", steps, opt)
    return name, "the recipe loop of docs/frameworks.md#torchtune", wrong, []


_RULES: dict[str, Rule] = {"hf": _hf, "lightning": _lightning, "accelerate": _accelerate, "torchtune": _torchtune}

"""Steps that call a bucket's kernel directly instead of the inner optimizer's ``step``, where that step would do
per-tensor Python work the result does not depend on: torch's fused Adam/AdamW (``_init_group``), and torchao 0.11's
Adam classes (a ``torch.compile`` wrapper built per tensor and call). Each states its precondition, checks it, and
takes the class's own step where it does not hold; each is bitwise that step (tests/test_fused_adam_step.py,
tests/test_torchao_step.py). :meth:`dist_optim.engine._stepper.Recipe.build` chooses them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from dist_optim._torch_internals import (
    dynamo_recompile_limit_lifted,
    foreach_add_,
    fused_adam_,
    fused_adamw_,
    unwrap_profiled_step,
)

__all__: list[str] = []


# -- Adam and AdamW, fused: the kernel without the per-tensor bookkeeping ------------------------------------------
FUSED_ADAM = (torch.optim.Adam, torch.optim.AdamW)  # exactly these classes: a subclass may step otherwise


def one_kind(params: list[torch.Tensor]) -> bool:
    """One device and dtype, real: torch would make one kernel call for them, as :class:`FusedAdamStep` does."""
    first = params[0]
    return not first.is_complex() and all(p.device == first.device and p.dtype == first.dtype for p in params)


class FusedAdamStep:
    """The step of an inner ``Adam``/``AdamW`` with ``fused=True``: torch's fused kernel called on the bucket's
    tensors with the arguments ``torch.optim`` passes it, skipping the Python work torch does per tensor before the
    call (``_init_group``: about as much time per tensor as the kernel on small tensors, and the standard loop pays
    it once per step too). The state is read anew each step. Anything this does not cover (a first step, which
    creates the state; a tensor ``lr`` or betas; ``differentiable``; a GradScaler's ``grad_scale`` on the
    optimizer; an option this torch does not know) takes the optimizer's own step."""

    # the options whose meaning this step knows; a torch with more takes its own step
    KNOWN = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                       "differentiable", "fused", "decoupled_weight_decay"})

    def __init__(self, step: Callable[[torch.optim.Optimizer], Any], decoupled: bool,
                 opt: torch.optim.Optimizer) -> None:
        self.step = step
        self.decoupled = decoupled
        self.known = set(opt.defaults) <= self.KNOWN  # whether every option of this torch's optimizer is known
        self.direct = 0  # steps that called the kernel directly (the others took torch's step)

    def __call__(self, opt: torch.optim.Optimizer) -> Any:
        if (not self.known or getattr(opt, "grad_scale", None) is not None
                or getattr(opt, "found_inf", None) is not None):
            return self.step(opt)
        calls = []
        state = opt.state
        for g in opt.param_groups:
            lr, (beta1, beta2) = g["lr"], g["betas"]
            if (isinstance(lr, torch.Tensor) or isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor)
                    or g["differentiable"] or not g["fused"]
                    or g.get("decoupled_weight_decay", self.decoupled) != self.decoupled):
                return self.step(opt)
            params = [p for p in g["params"] if p.grad is not None]
            states = [state.get(p) for p in params]
            if not all(states) or any(p.grad.is_sparse for p in params):
                return self.step(opt)  # the first step creates the state; sparse gradients: torch's error
            maxes = [s["max_exp_avg_sq"] for s in states] if g["amsgrad"] else []
            calls.append((g, params, states, maxes, beta1, beta2))
        kernel = fused_adamw_ if self.decoupled else fused_adam_
        with torch.no_grad():
            for g, params, states, maxes, beta1, beta2 in calls:
                if not params:
                    continue
                steps = [s["step"] for s in states]
                foreach_add_(steps, 1)
                kernel(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                       [s["exp_avg_sq"] for s in states], maxes, steps, amsgrad=g["amsgrad"], lr=g["lr"],
                       beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"],
                       maximize=g["maximize"], grad_scale=None, found_inf=None)
        self.direct += 1
        return None


# -- torchao's Adam classes: their compiled per-tensor step, compiled once ------------------------------------------
TORCHAO_VERSION = "0.11"  # the torchao whose ``_AdamBase.step`` TorchaoAdamStep repeats, argument for argument


def torchao_version() -> str | None:
    """The version of the torchao imported in this process (None where none is: no class of it can be in use)."""
    torchao = sys.modules.get("torchao")
    return getattr(torchao, "__version__", None) if torchao is not None else None


def torchao_adam_function(cls: type, version: str | None) -> Callable[..., Any] | None:
    """torchao's ``single_param_adam`` where ``cls`` steps with torchao's own ``_AdamBase.step`` (the class does
    not override it) and ``version`` is a torchao ``0.11.*``, the step :class:`TorchaoAdamStep` was written
    against; else None (the class's own step)."""
    if version is None or not (version == TORCHAO_VERSION or version.startswith(TORCHAO_VERSION + ".")):
        return None
    adam = sys.modules.get("torchao.optim.adam")
    base = getattr(adam, "_AdamBase", None)
    function = getattr(adam, "single_param_adam", None)
    if base is None or function is None or not (isinstance(cls, type) and issubclass(cls, base)):
        return None
    return function if unwrap_profiled_step(cls.step) is unwrap_profiled_step(base.step) else None


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}  # torchao's function -> it compiled, once per process


class TorchaoAdamStep:
    """The step of an inner torchao Adam/AdamW (8-bit, 4-bit, fp8 states; 0.11): torchao's own per-tensor function
    compiled once, called with the arguments and under the settings torchao's ``_AdamBase.step`` uses (no grad,
    ``fullgraph=True, dynamic=False``, dynamo's recompile limits lifted), so the result is that step's bit for bit.
    torchao's step builds a new ``torch.compile`` wrapper for every tensor at every step (0.39-0.41 ms a tensor
    measured on CPU, against 0.21 ms here),
    which the standard loop pays once per tensor and a bucket's step too; this pays it once.

    Precondition, checked when the bucket is built (:func:`torchao_adam_function`): torchao 0.11.*, and a class
    that keeps ``_AdamBase.step``. At each step torchao's own step runs instead, whole, where a tensor has no state
    yet (its first step creates it), a gradient is sparse (torchao's error) or a group's ``lr`` is not a tensor
    (torchao's error)."""

    def __init__(self, step: Callable[[torch.optim.Optimizer], Any], function: Callable[..., Any]) -> None:
        self.step = step
        self.function = function
        self.direct = 0  # steps that called the compiled function directly (the others took torchao's step)

    def __call__(self, opt: torch.optim.Optimizer) -> Any:
        calls = []
        state = opt.state
        for g in opt.param_groups:
            if not isinstance(g["lr"], torch.Tensor):
                return self.step(opt)
            for p in g["params"]:
                grad = p.grad
                if grad is None:
                    continue
                s = state.get(p)
                if not s or grad.is_sparse:
                    return self.step(opt)
                calls.append((p, grad, s, g))
        compiled = _COMPILED.get(self.function)
        if compiled is None:
            compiled = _COMPILED[self.function] = torch.compile(self.function, fullgraph=True, dynamic=False)
        with torch.no_grad(), dynamo_recompile_limit_lifted():
            for p, grad, s, g in calls:
                s["step"] += 1
                compiled(p.detach(), grad, s["step"], s["exp_avg"], s["exp_avg_sq"], s.get("max_exp_avg_sq"),
                         g["lr"], g["betas"][0], g["betas"][1], g["weight_decay"], g["eps"], opt.is_adamw,
                         opt.bf16_stochastic_round and p.dtype is torch.bfloat16)
        self.direct += 1
        return None

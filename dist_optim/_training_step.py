"""The edges of a training step around the engine: which backwards step, the hooks that fire, what ``step()`` does.

:class:`TrainingStep` is the engine's :class:`~dist_optim.engine._engine.Owner` and owns the step's counters: the
accumulation gate (``no_step()``, ``accumulation_steps``), the count of stepping backwards between two ``step()``
calls (a loop that accumulates as for a standard optimizer), the check for gradients no optimizer steps, the step
hooks, the two backwards of ``clip_mode="two_pass"`` and the standard ``step()`` on gradients left in ``.grad``.
``InBackwardOptimizer`` is the ``torch.optim.Optimizer`` surface over it.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any, Protocol

import torch

from dist_optim import _torch_internals as internals
from dist_optim._frameworks import Watch, adapted_framework_above
from dist_optim.engine._buckets import OUTSIDE_BACKWARD, Run
from dist_optim.engine._engine import Engine
from dist_optim.engine._grad_policy import GradPolicy
from dist_optim.engine._inputs import check_single_process, is_dtensor
from dist_optim.engine._options import InBackwardOptions, check_for_params
from dist_optim.engine._owners import is_owned
from dist_optim.parallel._ddp import DDPCommHook
from dist_optim.parallel._fsdp2 import accumulated_unsharded

__all__: list[str] = []


class Facade(Protocol):
    """What the training step uses of the optimizer it serves (``InBackwardOptimizer``); the facade itself is also
    what step hooks, bucket step hooks and the framework watch are handed."""

    param_groups: list[dict[str, Any]]

    def param_name(self, p: torch.Tensor) -> str:
        """``p``'s name, for errors."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The facade's ``step()``, which a stepping backward's end calls."""


class TrainingStep:
    """One optimizer's training-step edges (the engine's owner); ``opt`` is the facade it serves."""

    def __init__(self, opt: Facade, options: InBackwardOptions,
                 frozen: list[tuple[str, weakref.ref]], fsdp_units: list[Any] | None) -> None:
        self.opt = opt
        self.options = options
        self.policy = GradPolicy(options)
        self.engine: Engine | None = None  # the facade builds it with this as its owner, then sets it here
        self.ddp_hook: DDPCommHook | None = None  # once attached to the DDP model, which keeps it
        self.ddp_param_ids: set[int] = set()  # parameters DDP reduces (stepped by its communication hook)
        # The module's parameters left out as frozen: one unfrozen later would never be stepped. Weak references,
        # so that the optimizer keeps no more of the model alive than its own parameters.
        self.frozen = frozen
        self.fsdp_units = fsdp_units  # FSDP2 units, whose accumulated unsharded gradients two_pass must see
        self.framework_watch = Watch()  # a framework that clips or accumulates after backward: refused
        self.bucket_step_hooks: dict[int, Callable[[Any, list[torch.Tensor]], None]] = OrderedDict()
        # plain tensors were accepted in a single process: every backward checks that no multi-rank group has
        # appeared since (a model wrapped in DDP afterwards would step on local gradients)
        self.recheck_world = False
        self.micro_batches = 0  # backwards accumulated since the last step
        self.no_step_depth = 0  # nesting of no_step() contexts
        self.stepping_backwards = 0  # backwards that ran a full in-backward step since the last step() call
        self.warned_several_steps = False
        self.measuring = False  # around the first backward of a two-pass step
        self.finishing = False  # inside the step() that the end of a stepping backward calls

    # -- options ------------------------------------------------------------------------------------------------
    def admit(self, tensors: list[torch.Tensor], existing: list[torch.Tensor]) -> None:
        """Check a new group's ``tensors`` (beside the ``existing`` ones) against the job they train in: plain
        tensors in a multi-rank job, the options over these kinds of tensors, accumulation over DTensors."""
        options = self.options
        plain = [t for t in tensors if id(t) not in self.ddp_param_ids and not is_dtensor(t)]
        every = [*existing, *tensors]
        check_single_process(options.allow_local_steps, plain, next_to_dtensors=any(is_dtensor(t) for t in every))
        check_for_params(options, every)
        if options.accumulation_steps > 1 and any(is_dtensor(p) for p in tensors):
            raise NotImplementedError(
                "accumulation_steps > 1 with DTensor (FSDP2) parameters: FSDP2 runs no gradient hook on the "
                "micro-batches where it does not reduce, so they cannot be counted. Call "
                "model.set_requires_gradient_sync(False) before the backwards that only accumulate and True before "
                "the last one, with accumulation_steps=1 (or use opt.no_step(), which keeps reducing)"
            )
        if plain and not options.allow_local_steps:
            self.recheck_world = True

    def reconfigure(self, options: InBackwardOptions) -> None:
        """Take new options between two steps: a new policy, which keeps the previous step's norm and stats."""
        policy, old = GradPolicy(options), self.policy
        policy.previous_norm, policy.stats, policy.norm_rank = old.previous_norm, old.stats, old.norm_rank
        self.options, self.policy = options, policy

    # -- the engine's Owner -------------------------------------------------------------------------------------
    def backward_begins(self) -> Run:
        if self.measuring:
            return Run.MEASURE  # counted by the stepping backward that follows
        if self.recheck_world and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.check_still_single_process()
        if self.no_step_depth:
            self.stepping_backwards = 0  # accumulating knowingly: several steps per step() are meant
            return Run.ACCUMULATE
        self.micro_batches += 1
        if self.micro_batches < self.options.accumulation_steps:
            return Run.ACCUMULATE
        self.micro_batches = 0
        self.framework_watch.at_backward(self.opt)
        return Run.STEP

    def grad_policy(self) -> GradPolicy:
        return self.policy

    def param_name(self, p: torch.Tensor) -> str:
        return self.opt.param_name(p)

    def step_begins(self) -> None:
        opt = self.opt
        for hook in chain(internals.global_step_pre_hooks().values(), internals.step_pre_hooks(opt).values()):
            hook(opt, (), {})

    def bucket_stepped(self, params: list[torch.Tensor]) -> None:
        for hook in self.bucket_step_hooks.values():
            hook(self.opt, params)

    def step_ends(self, stepped: bool) -> None:
        self.policy.end(self.opt)
        self.check_unowned_grads()
        if stepped:
            if self.options.accumulation_steps == 1:  # with k > 1, a step() that flushes a partial window is meant
                self.stepping_backwards += 1
            # Through the public step(), so that wrappers installed on it (LR schedulers) see the step happen.
            self.finishing = True
            try:
                self.opt.step()
            finally:
                self.finishing = False

    # -- the facade's training-step methods ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        self.no_step_depth += 1
        try:
            yield
        finally:
            self.no_step_depth -= 1

    def step(self, closure: Callable[[], Any] | None, caller: Any) -> Any:
        """``opt.step(closure)`` called from the frame ``caller``; see ``InBackwardOptimizer.step``."""
        opt = self.opt
        if self.finishing:
            self.run_post_hooks()
            return None
        self.framework_watch.at_step(opt)
        self._check_steps_since_step()
        loss = None
        if closure is not None:
            if self.ddp_hook is not None or adapted_framework_above(caller):
                with torch.enable_grad():
                    loss = closure()
            else:
                with torch.enable_grad(), self.no_step():
                    loss = closure()
        if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
            self.micro_batches = 0
            # one bucket of every tensor, unscaled/checked/clipped, then stepped or skipped, as in backward
            stepped = self.engine.step_standard(
                [(gi, list(g["params"])) for gi, g in enumerate(opt.param_groups) if g["params"]]
            )
            self.policy.end(opt)
            if stepped:
                self.run_post_hooks()
        return loss

    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None, retain_graph: bool | None) -> None:
        """``opt.backward(loss, ...)``: one plain backward, or the two of a two-pass step."""
        if internals.graph_task_id() != OUTSIDE_BACKWARD:
            raise RuntimeError("opt.backward() was called during a backward")
        policy, ddp, opt = self.policy, self.ddp_hook, self.opt
        if (not policy.two_pass or self.no_step_depth or self.micro_batches + 1 < self.options.accumulation_steps
                or (ddp is not None and not ddp.reduces())):  # only accumulates (DDP: forward under no_sync())
            torch.autograd.backward(loss, gradient, retain_graph=retain_graph)
            return
        # Held in one backward, as exact clipping holds them: gradients of earlier micro-batches in .grad (or in
        # FSDP2's unsharded gradients, after backwards without sync), which a measuring pass would consume; DDP's
        # first iteration, which learns its buckets from one backward.
        if ((ddp is not None and ddp.learns_buckets())
                or any(p.grad is not None for g in opt.param_groups for p in g["params"])
                or accumulated_unsharded(self.fsdp_units or [])):
            self._backward_in_phase("held", loss, gradient, retain_graph)
            return
        if self.fsdp_units is None and any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
            raise NotImplementedError(
                "clip_mode='two_pass' over DTensor parameters given as tensors: build the optimizer from the model "
                "(InBackwardOptimizer(model, ...)), so that it sees the gradients FSDP2 accumulates without sync"
            )
        before = self.engine.backward
        self.measuring = True
        try:
            self._backward_in_phase("measure", loss, gradient, True)
        finally:
            self.measuring = False
        if self.engine.backward is before:
            return  # no gradient hook ran (an FSDP2 backward without gradient sync): it only accumulated
        if not policy.finish_measure():  # skipped, as scaler.step(opt) or nonfinite="skip" skip it
            policy.end(opt)
            return
        if ddp is not None:
            ddp.expect_backward(loss)
        self._backward_in_phase("step", loss, gradient, retain_graph)

    def _backward_in_phase(self, phase: str, loss: torch.Tensor, gradient: torch.Tensor | None,
                           retain_graph: bool | None) -> None:
        self.policy.phase = phase
        try:
            torch.autograd.backward(loss, gradient, retain_graph=retain_graph)
        finally:
            self.policy.phase = ""

    # -- checks -------------------------------------------------------------------------------------------------
    def check_still_single_process(self) -> None:
        """Once per backward: plain tensors accepted before a process group existed must not now step locally."""
        try:
            plain = [p for g in self.opt.param_groups for p in g["params"]
                     if id(p) not in self.ddp_param_ids and not is_dtensor(p)]
            check_single_process(False, plain)
        except RuntimeError as e:
            raise RuntimeError(
                f"{e}. This optimizer was built before the process group existed; build it after wrapping the "
                "model (InBackwardOptimizer(ddp_model, ...))"
            ) from None

    def _check_steps_since_step(self) -> None:
        n, self.stepping_backwards = self.stepping_backwards, 0
        strict = self.options.strict
        if n <= 1 or (self.warned_several_steps and not strict):
            return
        message = (
            f"{n} backwards each ran a full optimizer step since the last step() call: this optimizer steps inside "
            "every backward (accumulation_steps=1), so a loop that accumulates gradients "
            f"over {n} micro-batches before calling step() made {n} optimizer steps instead of one. Pass "
            f"accumulation_steps={n}, or run the micro-batches that only accumulate inside `with opt.no_step():`, "
            "or use the framework's adapter in dist_optim.integrations"
        )
        if strict:
            raise RuntimeError(f"{message} (strict=True)")
        self.warned_several_steps = True
        warnings.warn(f"{message}; strict=True raises this instead", UserWarning, stacklevel=4)

    def check_unowned_grads(self) -> None:
        """Once per optimizer: a parameter of the module that no optimizer steps in backward (frozen at
        construction, unfrozen since) got a gradient, which would grow forever."""
        index = self.engine.index_of
        for name, ref in self.frozen:
            p = ref()
            if p is not None and p.grad is not None and id(p) not in index and not is_owned(p):
                self.frozen = []
                warnings.warn(
                    f"parameter {name} got a gradient but no optimizer steps it (it did not require grad when this "
                    "optimizer was built, from the module): it is never trained and its .grad grows with every "
                    "backward. Build the optimizer after unfreezing it, or add it with opt.add_param_group",
                    UserWarning,
                    stacklevel=2,
                )
                return

    def run_post_hooks(self) -> None:
        opt = self.opt
        for hook in chain(internals.step_post_hooks(opt).values(), internals.global_step_post_hooks().values()):
            hook(opt, (), {})

    def detach(self) -> None:
        """After ``opt.remove()``: ``step()`` is the step from now on."""
        self.stepping_backwards = 0


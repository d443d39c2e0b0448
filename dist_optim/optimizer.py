"""``InBackwardOptimizer``: a real ``torch.optim.Optimizer`` whose step runs inside ``backward()``.

Its ``param_groups`` and ``state`` are the live ones: LR schedulers, ``state_dict()``/``load_state_dict()`` and step
hooks work as with the wrapped optimizer, while the update itself is done bucket by bucket by the engine as soon as
the gradients of a bucket are ready, and those gradients are freed at once.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dist_optim import _torch_internals as internals
from dist_optim._optimizer_views import OptionsAndTelemetry
from dist_optim._training_step import TrainingStep
from dist_optim.engine._class_state import (
    class_load_state_dict,
    class_state_dict,
    convert_loaded_state,
    forwarded_attribute,
    own_class,
)
from dist_optim.engine._engine import Engine
from dist_optim.engine._fingerprint import (
    agreement_groups,
    announce_failure,
    check_same_options,
)
from dist_optim.engine._guards import compiled_autograd_message
from dist_optim.engine._inputs import (
    NOT_GIVEN,
    check_given,
    check_optimizer_class,
    check_sparse_modules,
    checked_entries,
    first_tensor,
    module_params,
    name_in,
    names_of,
    norm_order_of,
    param_groups_of,
    split_group,
    warn_fused_with_uneven_scale,
)
from dist_optim.engine._options import (
    DEFAULT_BUCKET_CAP_MB,
    InBackwardOptions,
    options_from,
)
from dist_optim.engine._owners import check_unowned, record_owner, release
from dist_optim.engine._rule import check_group
from dist_optim.engine._saving import SavingWatch
from dist_optim.engine._stepper import Recipe
from dist_optim.parallel._ddp import (
    DDPCommHook,
    check_ddp,
    ddp_managed,
    reordering_refused,
)
from dist_optim.parallel._fsdp2 import fsdp_units

__all__: list[str] = []


class InBackwardOptimizer(OptionsAndTelemetry, torch.optim.Optimizer):
    r"""Run ``optimizer_class``'s step inside ``backward()``, bucket by bucket, and free each gradient at once.

    Each parameter's gradient, once accumulated, joins a bucket; when the last gradient of a bucket arrives, the
    bucket is stepped with one call of the wrapped optimizer (its ``fused`` kernel where torch has one for these
    parameters, else ``foreach``, unless you chose one) and its gradients are set to ``None``. Gradients that
    never arrive are not stepped; a partial bucket is stepped when backward ends. The result equals the standard
    loop ``loss.backward(); opt.step(); opt.zero_grad()`` with the same optimizer and implementation.

    The optimizer lives as long as the parameters it steps, which hold it (as ``_in_backward_engine`` in their
    ``__dict__``; a copy or a pickle of a parameter holds an empty ``OrderedDict`` there instead, and is not
    stepped): dropping the last reference to it does not stop training, and dropping model and optimizer frees
    both. :meth:`remove` detaches it.

    Args:
        params: what ``torch.optim`` accepts (tensors, ``named_parameters()``, param-group dicts) or an
            ``nn.Module``, whose frozen parameters are skipped: plain, DDP-wrapped (stepped after each bucket's
            all-reduce), FSDP2-sharded (stepped on the shards after reduce-scatter) or tensor-parallel
            (``parallelize_module``, alone or under FSDP2; a gradient whose placements differ from its
            parameter's, such as a SequenceParallel norm's ``Partial`` one, is stepped through DTensor's ops).
            A group may carry its own ``"optimizer_class"``; such a group takes its options from the group dict
            and that class's defaults, not from ``optimizer_kwargs``.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (not an instance), e.g. ``torch.optim.AdamW``.
            A class whose step is not torch's own (pytorch-optimizer, torch-optimi, schedule-free, bitsandbytes,
            torchao, yours) is stepped on small probe tensors at construction and refused unless stepping it per
            bucket equals its own loop (docs/optimizers.md); its ``train()``/``eval()`` are forwarded.
        bucket_cap_mb, per_parameter, allow_local_steps, accumulation_steps, max_grad_norm, clip_mode,
        grad_norm_type, max_grad_value, track_grad_norm, grad_scaler, overflow, nonfinite, strict, random_draws: the
            engine options, keyword-only, each documented under its name in :class:`~dist_optim.InBackwardOptions`
            (``help(dist_optim.InBackwardOptions)``): the bucket cap (default 4 MiB), gradient accumulation,
            clipping (``clip_mode="two_pass"`` keeps the memory saving that ``"exact"`` gives up), a GradScaler,
            non-finite gradients, and random draws.
        grad_norm_order: the tensors in the order ``clip_grad_norm_`` would be given them (e.g.
            ``model.parameters()``): the global norm combines the per-tensor norms in that order, exactly as
            ``clip_grad_norm_`` does, so that norm and clipping coefficient are bitwise its own. Default: the order
            the tensors were given in (a module's parameter order when built from a module). Tensors this optimizer
            does not step are ignored; tensors it steps that are not listed come last, in their given order.
        ddp_comm_hook: with a ``DistributedDataParallel`` model, the communication hook that reduces each bucket
            before it is stepped (default: DDP's mean all-reduce), e.g. torch's ``fp16_compress_hook``.
        ddp_comm_state: the state passed to ``ddp_comm_hook``.
        options: an :class:`~dist_optim.InBackwardOptions` holding the engine options above (from
            ``bucket_cap_mb`` to ``random_draws``) as one object, in place of those keywords, which must then be left
            out; read back as :attr:`options`.
        **optimizer_kwargs: options of ``optimizer_class`` (``lr``, ``weight_decay``, ...), checked by
            ``optimizer_class`` itself at construction.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, ``optimizer_kwargs`` has an unknown option, or
            ``params`` is a set (unordered, as ``torch.optim`` refuses).
        ValueError: a tensor is not a leaf, does not require grad, is on the meta device, or is given twice; the
            optimizer needs a closure (LBFGS); an engine option is out of range; both ``options`` and an engine
            keyword are given; under DDP, FSDP2 or tensor parallel, an option differs across ranks (raised on every
            rank).
        RuntimeError: a multi-rank process group is initialised, some parameters are plain tensors (neither
            DDP's nor DTensors, e.g. a norm left out of a tensor-parallel plan) and ``allow_local_steps`` is not
            set; compiled autograd is on.
        NotImplementedError: gradient norms (``max_grad_norm``, ``track_grad_norm``, ``nonfinite``) over plain
            tensors next to DTensors; FSDP1; ``accumulation_steps > 1`` with DDP or DTensor parameters;
            ``optimizer_class`` cannot be stepped one bucket at a time (its step couples tensors, keeps a counter of
            its own, fails on probe tensors, draws random numbers per tensor without ``random_draws="reordered"``):
            the message says why and whether ``bucket_cap_mb=float("inf")`` makes it exact.

    Example:
        >>> import torch, dist_optim
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = dist_optim.InBackwardOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
        >>> before = model.weight.detach().clone()
        >>> model(torch.randn(8, 4)).square().mean().backward()  # steps every parameter
        >>> bool((model.weight != before).any()), model.weight.grad is None
        (True, True)
        >>> sorted(opt.state_dict()["state"][0])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    def __init__(
        self,
        params: Any = NOT_GIVEN,
        optimizer_class: type[torch.optim.Optimizer] = NOT_GIVEN,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        per_parameter: bool = False,
        allow_local_steps: bool = False,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        clip_mode: str = "exact",
        grad_norm_type: float = 2.0,
        max_grad_value: float | None = None,
        track_grad_norm: bool = False,
        grad_norm_order: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        overflow: str = "exact",
        nonfinite: str = "ignore",
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_state: Any = None,
        strict: bool = False,
        random_draws: str = "exact",
        options: InBackwardOptions | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        check_given(params is not NOT_GIVEN, optimizer_class is not NOT_GIVEN)
        ddp = params if isinstance(params, nn.parallel.DistributedDataParallel) else None
        module = params if isinstance(params, nn.Module) else None
        groups = param_groups_of(module_params(module) if module is not None else params)
        # Every rank of these groups must build the optimizer alike (checked in _build); a rank that raises before
        # the check takes part in it with its error, so that the others raise too instead of waiting for it.
        agree_on = agreement_groups(ddp, groups)
        checked: list[bool] = []  # appended to once every rank is in the check
        try:
            check_optimizer_class(optimizer_class)
            options = options_from(options, dict(
                bucket_cap_mb=bucket_cap_mb, per_parameter=per_parameter, allow_local_steps=allow_local_steps,
                accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm, clip_mode=clip_mode,
                grad_norm_type=grad_norm_type, max_grad_value=max_grad_value, track_grad_norm=track_grad_norm,
                grad_scaler=grad_scaler, overflow=overflow, nonfinite=nonfinite, strict=strict,
                random_draws=random_draws,
            ))
            if internals.compiled_autograd_configured():
                raise RuntimeError(compiled_autograd_message())
            self._norm_order: dict[int, int] = {}  # id(tensor) -> its place in grad_norm_order
            check_ddp(ddp, options.accumulation_steps, ddp_comm_hook)
            frozen = [(name, weakref.ref(p)) for name, p in module.named_parameters()
                      if not p.requires_grad] if module is not None else []
            edges = self._edges = TrainingStep(self, options, frozen,
                                               fsdp_units(module) if module is not None else None, module)
            if module is not None:
                check_sparse_modules(module, optimizer_class)
            self._build(ddp, groups, optimizer_class, optimizer_kwargs, options, edges, grad_norm_order,
                        ddp_comm_hook, ddp_comm_state, agree_on, checked)
        except Exception as e:
            if agree_on and not checked:
                with contextlib.suppress(Exception):  # the user sees their error, not a failed announcement's
                    announce_failure(agree_on, e)
            raise

    def _build(self, ddp: Any, groups: list[Any], optimizer_class: type[torch.optim.Optimizer],
               optimizer_kwargs: dict[str, Any], options: InBackwardOptions, edges: TrainingStep,
               grad_norm_order: Any, ddp_comm_hook: Any, ddp_comm_state: Any, agree_on: list[Any],
               checked: list[bool]) -> None:
        self._optimizer_class = optimizer_class
        self._recipe = Recipe(self, optimizer_class, optimizer_kwargs)
        # Under DDP: parameters DDP reduces are stepped by its communication hook; the ones it ignores keep a local
        # step, as in DDP's standard loop.
        edges.ddp_param_ids = {id(p) for p in ddp.parameters()} if ddp is not None else set()
        reductions = DDPCommHook(ddp, ddp_comm_hook, ddp_comm_state) if ddp is not None else None
        self._engine = edges.engine = Engine(
            edges,
            self._recipe,
            options.cap_bytes,
            options.per_parameter,
            reductions,
            frozenset(ddp_managed(ddp)) if ddp is not None else frozenset(),
        )
        self._recipe.one_step = math.isinf(options.bucket_cap_mb) and not options.per_parameter and ddp is None
        self._recipe.random_draws, self._recipe.reordering_refused = options.random_draws, reordering_refused(ddp)
        defaults = self._recipe.defaults(first_tensor(groups), groups)
        try:
            super().__init__(groups, defaults)
            self._norm_order = norm_order_of(grad_norm_order)
            self._rank_norms()
            edges.framework_watch.at_construction(self)
            checked.append(True)  # from here on, every rank is in the check
            if agree_on:
                check_same_options(self, agree_on, optimizer_class)
            if reductions is not None:
                reductions.attach(self._engine)
                edges.ddp_hook = reductions
            warn_fused_with_uneven_scale(options.grad_scaler, self._recipe.kernels, self.param_groups)
            self._saving = SavingWatch()
            self._saving.check(options, self.grad_bytes, stacklevel=4)
        except BaseException:
            self.remove()  # nothing stays attached from the groups that were accepted before the bad one
            raise

    # -- what the wrapped class adds ----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """``train()``/``eval()`` of a class that has them (schedule-free), run on this optimizer's groups and
        state; any other attribute the class adds is refused by name (it would act on one bucket's optimizer, or
        on none), so that ``hasattr(opt, name)`` is ``False`` for it as for any missing attribute."""
        recipe = self.__dict__.get("_recipe")
        if recipe is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return forwarded_attribute(self, recipe, name)

    # -- groups -------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters are stepped in backward from the next backward on.

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``; may carry ``"optimizer_class"``.
        """
        cls, group, entries = split_group(param_group, len(self.param_groups), self._optimizer_class)
        existing = [p for g in self.param_groups for p in g["params"]]
        tensors = checked_entries(entries, existing, len(self.param_groups))
        self._edges.admit(tensors, existing)
        group["params"] = entries
        # The class fills its own defaults and checks its options (and the tensors) now, not at the first backward.
        probe = self._recipe.fill(cls, group)
        filled = probe.param_groups[0]
        names = names_of(filled, self.param_groups)
        by_id = {id(p): n for p, n in zip(filled["params"], names)}
        check_unowned(filled["params"], self, lambda p: by_id.get(id(p), "<unknown>"))
        check_group(self._recipe, cls, filled)  # before anything is recorded: a refused group leaves no trace
        self.state.update(probe.state)  # state some classes create at construction (Adagrad's sum)
        self.param_groups.append(filled)
        self._recipe.add_group(cls, filled)
        handles = self._engine.add_params(len(self.param_groups) - 1, filled["params"])
        for p, handle in zip(filled["params"], handles):
            record_owner(p, self, handle)
        self._rank_norms()

    def register_bucket_step_hook(
        self, hook: Callable[[InBackwardOptimizer, list[torch.Tensor]], None]
    ) -> RemovableHandle:
        """Register a hook called right after each bucket is stepped, inside ``backward()``, and after a standard
        :meth:`step`, with the tensors just stepped (those of the bucket that had a gradient, still set).

        The hook has the signature ``hook(optimizer: InBackwardOptimizer, params: list[Tensor]) -> None``; it runs
        once per bucket, in the order buckets are stepped, between the step pre hooks and post hooks of the
        training step. Use it for work that should follow each parameter while it is hot (EMA, logging).

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Example:
            >>> import torch, dist_optim
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = dist_optim.InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, per_parameter=True)
            >>> seen = []
            >>> handle = opt.register_bucket_step_hook(lambda o, params: seen.append(len(params)))
            >>> model(torch.randn(3, 4)).sum().backward()
            >>> seen  # bias and weight, each a bucket of its own
            [1, 1]
            >>> handle.remove()
        """
        hooks = self._edges.bucket_step_hooks
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def param_name(self, p: torch.Tensor) -> str:
        """The name of ``p`` in this optimizer (its ``param_names`` entry, else ``param_groups[g][k]``)."""
        return name_in(self.param_groups, p)

    # -- the training step --------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None, *,
                 retain_graph: bool | None = None) -> None:
        """``loss.backward(gradient)``, and with ``clip_mode="two_pass"`` the exact global-norm clipping that keeps
        the memory saving: a measuring backward over the retained graph (each bucket's gradients measured as they
        complete, then freed; nothing stepped), the global norm and clipping coefficient, then the stepping
        backward, which clips and steps each bucket as it completes. The result is ``clip_grad_norm_(params,
        max_grad_norm); opt.step()``'s, bitwise when both backwards compute the same gradients (deterministic
        kernels; a warning says when the two norms differ). Under DDP the first pass reduces too, so the norm is
        of the averaged gradients; DDP's first iteration, in which DDP learns its bucket order from the backward
        (``find_unused_parameters=False``), is one backward that holds the gradients as ``"exact"`` does. A
        GradScaler overflow or a non-finite gradient (``nonfinite="skip"``) found by the first pass skips the step
        without the second.

        A backward that only accumulates (inside :meth:`no_step`, or before the last of ``accumulation_steps``)
        is one plain backward; the window's last one, whose gradients partly live in ``.grad`` already, is one
        backward that holds the gradients as ``clip_mode="exact"`` does (they are all alive anyway).

        Args:
            loss: the tensor to differentiate (a scalar unless ``gradient`` is given).
            gradient: as for ``Tensor.backward``.
            retain_graph: keep the graph after the last backward, as for ``Tensor.backward``.

        Raises:
            RuntimeError: called during a backward.
            NotImplementedError: ``clip_mode="two_pass"`` with ``DistributedDataParallel(static_graph=True)``, or
                over DTensor parameters given as tensors rather than as the model.

        Example:
            >>> import torch, dist_optim
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = dist_optim.InBackwardOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=0.5,
            ...                                      clip_mode="two_pass")
            >>> opt.backward(model(torch.randn(8, 4)).square().mean())  # measures, then clips and steps
            >>> model.weight.grad is None, bool(opt.last_step.clip_coef <= 1)
            (True, True)
        """
        self._edges.backward(loss, gradient, retain_graph)

    def no_step(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside this context only accumulate gradients into ``.grad``: nothing is stepped or freed, and
        they do not count towards ``accumulation_steps``. The first backward outside it steps on the sum, like
        DDP's ``no_sync()``.

        Example:
            >>> import torch, dist_optim
            >>> model = torch.nn.Linear(3, 1)
            >>> opt = dist_optim.InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
            >>> with opt.no_step():
            ...     model(torch.ones(2, 3)).sum().backward()  # accumulates
            >>> model.weight.grad is not None
            True
            >>> model(torch.ones(2, 3)).sum().backward()  # steps on both micro-batches, frees the gradients
            >>> model.weight.grad is None
            True
        """
        return self._edges.no_step()

    @internals.fires_own_step_hooks
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finish a training step; the update itself already ran inside ``backward()``.

        Kept so that an existing loop works unchanged: after an in-backward step there is nothing left to do and
        nothing happens. Gradients that are present but were not consumed in backward (set by hand, or after
        :meth:`remove`) are stepped here exactly like the wrapped optimizer would, with step hooks.

        Args:
            closure: optional; called with grad enabled. As in ``torch.optim``, the step uses exactly the
                gradients the closure leaves (it may set ``.grad`` after its backward): the closure's backwards
                only accumulate, as under :meth:`no_step`, and this call steps what they left, so the gradients
                are held until then (no memory saving). Under a framework's adapter whose closure runs the step's
                backward (Lightning with ``InBackwardCallback``), and under DDP, which reduces in every backward,
                the closure's backward steps in backward instead.

        Returns:
            The closure's result, or ``None``.

        Raises:
            RuntimeError: with ``strict=True``, more than one backward ran a full step since the last call.
            ValueError: the first call comes from a framework loop that clips or accumulates after backward, used
                without its adapter (dist_optim.integrations), which would train differently.
            FloatingPointError: with ``nonfinite="raise"``, a gradient stepped here is not finite.
        """
        return self._edges.step(closure, sys._getframe(1))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. After a backward that raised, it also means the next backward
        has no stale gradient to tell apart from its own, so it steps all of them (without it, the next backward
        drops what the failed one left, its first tensor's gradient included, and warns: docs/limitations.md,
        'A backward that raises')."""
        super().zero_grad(set_to_none)
        self._engine.gradients_cleared()

    # -- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``optimizer_class``'s state dict format. With ``clip_mode="previous_norm"`` after a step, one more key,
        ``"in_backward"``, holds the previous step's gradient norm, which the next step clips with (torch's
        ``load_state_dict`` ignores it)."""
        own = own_class(self._recipe, "state_dict")
        # the class's own format (bitsandbytes nests its quantised state), with this optimizer's hooks
        state_dict = super().state_dict() if own is None else class_state_dict(self, self._recipe, own)
        extra = self._edges.policy.extra_state()  # a collective for a DTensor norm: state_dict() is called on every rank
        if extra:
            state_dict["in_backward"] = extra
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict written by this class or by ``optimizer_class`` itself (same format)."""
        own = own_class(self._recipe, "load_state_dict")
        loaded = {k: v for k, v in state_dict.items() if k != "in_backward"}
        if own is None:
            super().load_state_dict(loaded)
        else:  # the class's own load (bitsandbytes keeps uint8 codes; pytorch-optimizer restores dtypes)
            class_load_state_dict(self, self._recipe, own, loaded)
        convert_loaded_state(self, self._recipe)
        self._recipe.choose_kernels()
        self._engine.rebuild()
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None:
            self._edges.policy.load_extra_state(state_dict.get("in_backward") or {}, like=first)

    def remove(self) -> None:
        """Detach every hook, and let the parameters go of this optimizer (until then they keep it alive, so that
        dropping the last reference to it does not stop training). The model then trains with a standard
        optimizer again, and this object behaves as one: :meth:`step` steps whatever gradients are present."""
        if self._edges.ddp_hook is not None:
            raise NotImplementedError(
                "cannot detach from a DistributedDataParallel model: DDP keeps its communication hook for its "
                "lifetime. Wrap the module in a new DDP to train it with a standard optimizer"
            )
        self._engine.remove()
        self._edges.detach()
        release((p for g in getattr(self, "param_groups", []) for p in g["params"]), self)

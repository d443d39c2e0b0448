"""``InBackwardOptimizer``: a real ``torch.optim.Optimizer`` whose step runs inside ``backward()``.

Its ``param_groups`` and ``state`` are the live ones: LR schedulers, ``state_dict()``/``load_state_dict()`` and step
hooks work as with the wrapped optimizer, while the update itself is done bucket by bucket by the engine as soon as
the gradients of a bucket are ready, and those gradients are freed at once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils.hooks import RemovableHandle

from dist_optim._ddp import DDPCommHook, check_ddp, ddp_managed
from dist_optim._engine import Engine, compiled_autograd_message
from dist_optim._fingerprint import check_same_options, sharding_groups
from dist_optim._frameworks import Watch, adapted_framework_above
from dist_optim._fsdp2 import accumulated_unsharded, fsdp_units
from dist_optim._grad_policy import GradPolicy, StepStats
from dist_optim._inputs import (
    as_list,
    check_optimizer_class,
    check_single_process,
    check_sparse_modules,
    check_tensor,
    is_dtensor,
    module_params,
)
from dist_optim._owners import check_unowned, is_owned, record_owner, release
from dist_optim._rule import MODE_SWITCHES, no_rng, switch_mode
from dist_optim._stepper import Recipe, hyperparameters

__all__: list[str] = []

DEFAULT_BUCKET_CAP_MB = 4.0
_UNCHANGED = object()
_NOT_GIVEN: Any = object()  # params and optimizer_class are required; a clear error says so


class InBackwardOptimizer(torch.optim.Optimizer):
    r"""Run ``optimizer_class``'s step inside ``backward()``, bucket by bucket, and free each gradient at once.

    Each parameter's gradient, once accumulated, joins a bucket; when the last gradient of a bucket arrives, the
    bucket is stepped with one call of the wrapped optimizer (its ``fused`` kernel where torch has one for these
    parameters, else ``foreach``, unless you chose one) and its gradients are set to ``None``. Gradients that
    never arrive are not stepped; a partial bucket is stepped when backward ends. The result equals the standard
    loop ``loss.backward(); opt.step(); opt.zero_grad()`` with the same optimizer and implementation.

    The optimizer lives as long as the parameters it steps, which hold it (as ``_in_backward_engine`` in their
    ``__dict__``, left out of copies and pickles): dropping the last reference to it does not stop training, and
    dropping model and optimizer frees both. :meth:`remove` detaches it.

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
        grad_norm_order: the tensors in the order ``clip_grad_norm_`` would be given them (e.g.
            ``model.parameters()``): the global norm combines the per-tensor norms in that order, exactly as
            ``clip_grad_norm_`` does, so that norm and clipping coefficient are bitwise its own. Default: the order
            the tensors were given in (a module's parameter order when built from a module). Tensors this optimizer
            does not step are ignored; tensors it steps that are not listed come last, in their given order.
        grad_scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` produced the backward: gradients are
            unscaled inside backward and checked; ``scaler.update()`` then works as usual.
        overflow: with ``grad_scaler``: ``"exact"`` holds the step's gradients until backward ends and steps all
            or nothing, like ``scaler.step``; ``"per_bucket"`` skips only the buckets that overflow (earlier
            buckets keep their step) and keeps the memory saving.
        nonfinite: without a scaler: ``"ignore"`` (the standard loop's behaviour), ``"skip"`` (buckets with a
            non-finite gradient are not stepped, counted in :attr:`last_step`; the whole step when gradients are
            held) or ``"raise"`` (``FloatingPointError`` naming the parameters).
        ddp_comm_hook: with a ``DistributedDataParallel`` model, the communication hook that reduces each bucket
            before it is stepped (default: DDP's mean all-reduce), e.g. torch's ``fp16_compress_hook``.
        ddp_comm_state: the state passed to ``ddp_comm_hook``.
        strict: raise instead of warning when a loop runs several stepping backwards between two :meth:`step`
            calls (gradient accumulation written for a standard optimizer, which steps here on every backward).
        **optimizer_kwargs: options of ``optimizer_class`` (``lr``, ``weight_decay``, ...), checked by
            ``optimizer_class`` itself at construction.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, ``optimizer_kwargs`` has an unknown option, or
            ``params`` is a set (unordered, as ``torch.optim`` refuses).
        ValueError: a tensor is not a leaf, does not require grad, is on the meta device, or is given twice; the
            optimizer needs a closure (LBFGS); an engine option is out of range; under DDP, FSDP2 or tensor
            parallel, an option differs across ranks (raised on every rank).
        RuntimeError: a multi-rank process group is initialised, some parameters are plain tensors (neither
            DDP's nor DTensors, e.g. a norm left out of a tensor-parallel plan) and ``allow_local_steps`` is not
            set; compiled autograd is on.
        NotImplementedError: gradient norms (``max_grad_norm``, ``track_grad_norm``, ``nonfinite``) over plain
            tensors next to DTensors; FSDP1; ``accumulation_steps > 1`` with DDP or DTensor parameters;
            ``optimizer_class`` cannot be stepped one bucket at a time (its step couples tensors, keeps a counter of
            its own, fails on probe tensors): the message says why and whether ``bucket_cap_mb=float("inf")`` makes
            it exact.

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
        params: Any = _NOT_GIVEN,
        optimizer_class: type[torch.optim.Optimizer] = _NOT_GIVEN,
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
        **optimizer_kwargs: Any,
    ) -> None:
        if params is _NOT_GIVEN or optimizer_class is _NOT_GIVEN:
            missing = " and ".join(n for n, v in (("params", params), ("optimizer_class", optimizer_class))
                                   if v is _NOT_GIVEN)
            raise TypeError(
                f"InBackwardOptimizer() got no {missing}: it is built as InBackwardOptimizer(params, optimizer_class, "
                "**options). A framework that calls a factory without arguments (HF Trainer's "
                "optimizer_cls_and_kwargs=(functools.partial(InBackwardOptimizer, ...), ...)) needs an optimizer "
                "class instead: dist_optim.in_backward(torch.optim.AdamW, **engine_options)"
            )
        check_optimizer_class(optimizer_class)
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and dynamo.config.compiled_autograd:
            raise RuntimeError(compiled_autograd_message())
        if not (isinstance(accumulation_steps, int) and accumulation_steps >= 1):
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        self._policy_options = dict(
            max_grad_norm=max_grad_norm,
            clip_mode=clip_mode,
            grad_norm_type=grad_norm_type,
            max_grad_value=max_grad_value,
            grad_scaler=grad_scaler,
            overflow=overflow,
            nonfinite=nonfinite,
            track_grad_norm=track_grad_norm,
        )
        self._policy = GradPolicy(**self._policy_options)
        self._norm_order: dict[int, int] = {}  # id(tensor) -> its place in grad_norm_order
        ddp = params if isinstance(params, nn.parallel.DistributedDataParallel) else None
        if ddp is not None:
            check_ddp(ddp)
            if accumulation_steps > 1:
                raise NotImplementedError(
                    "accumulation_steps > 1 with DDP: DDP reduces in every backward. Accumulate with "
                    "`with model.no_sync():` on the micro-batches that only accumulate, and accumulation_steps=1"
                )
        elif ddp_comm_hook is not None:
            raise ValueError("ddp_comm_hook is given but params is not a DistributedDataParallel model")
        # The module's parameters left out as frozen: one unfrozen later would never be stepped. Weak references,
        # so that the optimizer keeps no more of the model alive than its own parameters.
        self._frozen = [
            (name, weakref.ref(p)) for name, p in params.named_parameters() if not p.requires_grad
        ] if isinstance(params, nn.Module) else []
        # FSDP2 units, whose unsharded gradients accumulated without sync clip_mode="two_pass" must see
        self._fsdp_units = fsdp_units(params) if isinstance(params, nn.Module) else None
        if isinstance(params, nn.Module):
            check_sparse_modules(params, optimizer_class)
            params = module_params(params)
        if isinstance(params, set):
            raise TypeError(
                "params must be an ordered collection (a list), got a set, whose order changes between runs and "
                "would mismatch the state dict; pass a list"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params must be an iterable of Tensors, (name, Tensor) pairs or dicts, or an nn.Module, got a "
                "Tensor; wrap it in a list"
            )
        groups = list(params)
        if not groups:
            raise ValueError("InBackwardOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": as_list(g["params"])} if isinstance(g, dict) and "params" in g else g for g in groups]
        self._optimizer_class = optimizer_class
        self._recipe = Recipe(self, optimizer_class, optimizer_kwargs)
        self._finishing = False
        self._bucket_step_hooks: dict[int, Callable[[InBackwardOptimizer, list[torch.Tensor]], None]] = OrderedDict()
        self._allow_local_steps = allow_local_steps
        # plain tensors were accepted in a single process: every backward checks that no multi-rank group has
        # appeared since (a model wrapped in DDP afterwards would step on local gradients)
        self._recheck_world = False
        self._accumulation_steps = accumulation_steps
        self._micro_batches = 0  # backwards accumulated since the last step
        self._strict = strict
        self._backward_steps_since_step = 0  # in-backward steps since the last step() call
        self._warned_several_steps = False
        self._no_step_depth = 0
        # Under DDP: parameters DDP reduces are stepped by its communication hook; the ones it ignores keep a local
        # step, as in DDP's standard loop.
        self._ddp_param_ids = {id(p) for p in ddp.parameters()} if ddp is not None else set()
        reductions = DDPCommHook(ddp, ddp_comm_hook, ddp_comm_state) if ddp is not None else None
        self._ddp_hook: DDPCommHook | None = None  # once attached to the DDP model, which keeps it
        self._engine = Engine(
            _EngineOwner(self),
            self._recipe,
            sys.maxsize if math.isinf(bucket_cap_mb) else int(bucket_cap_mb * 2**20),
            per_parameter,
            reductions,
            frozenset(ddp_managed(ddp)) if ddp is not None else frozenset(),
        )
        self._recipe.one_step = math.isinf(bucket_cap_mb) and not per_parameter and ddp is None
        defaults = self._recipe.defaults(_first_tensor(groups), groups)
        self._framework_watch = Watch()  # a framework that clips or accumulates after backward: refused
        try:
            super().__init__(groups, defaults)
            self._norm_order = self._norm_order_of(grad_norm_order)
            self._rank_norms()
            self._framework_watch.at_construction(self)
            if ddp is not None or any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
                groups = [ddp.process_group] if ddp is not None else sharding_groups(
                    [p for g in self.param_groups for p in g["params"]])
                check_same_options(self, groups, accumulation_steps)
            if reductions is not None:
                reductions.attach(self._engine)
                self._ddp_hook = reductions
            _warn_fused_with_uneven_scale(grad_scaler, self._recipe.kernels, self.param_groups)
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
        classes = [c for c in dict.fromkeys(recipe.classes or [recipe.optimizer_class]) if hasattr(c, name)]
        if name in MODE_SWITCHES and all(callable(getattr(c, name)) for c in classes) and classes:
            return functools.partial(self._switch_mode, name)
        if classes:
            raise AttributeError(
                f"{classes[0].__name__}.{name} is not available on InBackwardOptimizer: it is not forwarded, since "
                "it would act on the optimizer of one bucket (or of none) rather than on this optimizer's groups "
                f"and state. Use {classes[0].__name__} with a standard training loop if you need it"
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _switch_mode(self, name: str) -> None:
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"{name}() was called during a backward; call it between two steps")
        for cls in dict.fromkeys(self._recipe.classes):
            if callable(getattr(cls, name, None)):
                groups = [g for c, g in zip(self._recipe.classes, self.param_groups) if c is cls]
                switch_mode(cls, name, groups, self.state, self.defaults)

    # -- groups -------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters are stepped in backward from the next backward on.

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``; may carry ``"optimizer_class"``.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        cls = group.pop("optimizer_class", self._optimizer_class)
        check_optimizer_class(cls)
        if "params" not in group:
            raise ValueError(f"param group {len(self.param_groups)} has no 'params' key")
        entries = as_list(group["params"])
        if not entries:
            raise ValueError(f"param group {len(self.param_groups)} has an empty 'params' list")
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for k, entry in enumerate(entries):
            name, p = entry if isinstance(entry, tuple) else (f"param_groups[{len(self.param_groups)}][{k}]", entry)
            check_tensor(p, name)
            if id(p) in known:
                raise ValueError(f"{name} appears in more than one place; each parameter may be given only once")
            known.add(id(p))
        tensors = [e[1] if isinstance(e, tuple) else e for e in entries]
        plain = [t for t in tensors if id(t) not in self._ddp_param_ids and not is_dtensor(t)]
        every = list(chain((q for g in self.param_groups for q in g["params"]), tensors))
        check_single_process(self._allow_local_steps, plain, next_to_dtensors=any(is_dtensor(t) for t in every))
        _check_norms_over_kinds(self._policy_options, every)
        _check_value_clipping(self._policy_options, every)
        if plain and not self._allow_local_steps:
            self._recheck_world = True
        if self._accumulation_steps > 1 and any(is_dtensor(p) for p in tensors):
            raise NotImplementedError(
                "accumulation_steps > 1 with DTensor (FSDP2) parameters: FSDP2 runs no gradient hook on the "
                "micro-batches where it does not reduce, so they cannot be counted. Call "
                "model.set_requires_gradient_sync(False) before the backwards that only accumulate and True before "
                "the last one, with accumulation_steps=1 (or use opt.no_step(), which keeps reducing)"
            )
        group["params"] = entries
        # The class fills its own defaults and checks its options (and the tensors) now, not at the first backward.
        probe = self._recipe.fill(cls, group)
        filled = probe.param_groups[0]
        names = filled.get("param_names") or [f"param_groups[{len(self.param_groups)}][{k}]"
                                               for k in range(len(filled["params"]))]
        if self.param_groups and ("param_names" in filled) != ("param_names" in self.param_groups[0]):
            raise ValueError(
                "all optimizer param groups should be with/without names. cannot add param group "
                f"{'with' if 'param_names' in filled else 'without'} names to the optimizer; give every group "
                "(name, tensor) pairs, e.g. from named_parameters(), or none"
            )
        by_id = {id(p): n for p, n in zip(filled["params"], names)}
        check_unowned(filled["params"], self, lambda p: by_id.get(id(p), "<unknown>"))
        self._recipe.check(cls, filled)  # before anything is recorded: a refused group leaves no trace
        self.state.update(probe.state)  # state some classes create at construction (Adagrad's sum)
        self.param_groups.append(filled)
        self._recipe.add_group(cls, filled)
        handles = self._engine.add_params(len(self.param_groups) - 1, filled["params"])
        for p, handle in zip(filled["params"], handles):
            record_owner(p, self, handle)
        self._rank_norms()

    @staticmethod
    def _norm_order_of(tensors: Any) -> dict[int, int]:
        """``grad_norm_order`` checked, as ``id(tensor) -> place`` (``None``: the given order)."""
        if tensors is None:
            return {}
        if isinstance(tensors, nn.Module):
            tensors = tensors.parameters()
        if isinstance(tensors, torch.Tensor) or isinstance(tensors, (set, frozenset)):
            raise TypeError(
                f"grad_norm_order must be an ordered iterable of tensors (e.g. model.parameters()) or an nn.Module, "
                f"got a {type(tensors).__name__}"
            )
        order: dict[int, int] = {}
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"grad_norm_order must hold tensors, got a {type(t).__name__}")
            order.setdefault(id(t), len(order))
        return order

    def _rank_norms(self) -> None:
        """Give the policy each stepped tensor's place in ``grad_norm_order`` (by the engine's index)."""
        index = self._engine.index_of
        self._policy.norm_rank = {index[k]: place for k, place in self._norm_order.items() if k in index}

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
        handle = RemovableHandle(self._bucket_step_hooks)
        self._bucket_step_hooks[handle.id] = hook
        return handle

    def param_name(self, p: torch.Tensor) -> str:
        """The name of ``p`` in this optimizer (its ``param_names`` entry, else ``param_groups[g][k]``)."""
        for gi, group in enumerate(self.param_groups):
            for k, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return names[k] if names else f"param_groups[{gi}][{k}]"
        return "<unknown>"

    # -- the training step --------------------------------------------------------------------------------------
    def _backward_steps(self) -> bool:
        """Called once at the start of every backward: does this one step, or accumulate a micro-batch?"""
        if self._recheck_world and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._check_still_single_process()
        if self._no_step_depth:
            self._backward_steps_since_step = 0  # accumulating knowingly: several steps per step() are meant
            return False
        self._micro_batches += 1
        if self._micro_batches < self._accumulation_steps:
            return False
        self._micro_batches = 0
        return True

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
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("opt.backward() was called during a backward")
        policy = self._policy
        ddp = self._ddp_hook
        if (not policy.two_pass or self._no_step_depth or self._micro_batches + 1 < self._accumulation_steps
                or (ddp is not None and not ddp.reduces())):  # only accumulates (DDP: forward under no_sync())
            torch.autograd.backward(loss, gradient, retain_graph=retain_graph)
            return
        # Held in one backward, as exact clipping holds them: gradients of earlier micro-batches in .grad (or in
        # FSDP2's unsharded gradients, after backwards without sync), which a measuring pass would consume; DDP's
        # first iteration, which learns its buckets from one backward.
        if ((ddp is not None and ddp.learns_buckets())
                or any(p.grad is not None for g in self.param_groups for p in g["params"])
                or accumulated_unsharded(self._fsdp_units or [])):
            self._backward_in_phase("held", loss, gradient, retain_graph)
            return
        if self._fsdp_units is None and any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise NotImplementedError(
                "clip_mode='two_pass' over DTensor parameters given as tensors: build the optimizer from the model "
                "(InBackwardOptimizer(model, ...)), so that it sees the gradients FSDP2 accumulates without sync"
            )
        engine = self._engine
        before = engine.backward
        engine.measuring = True
        try:
            self._backward_in_phase("measure", loss, gradient, True)
        finally:
            engine.measuring = False
        if engine.backward is before:
            return  # no gradient hook ran (an FSDP2 backward without gradient sync): it only accumulated
        if not policy.finish_measure():  # skipped, as scaler.step(opt) or nonfinite="skip" skip it
            policy.end(self)
            return
        if ddp is not None:
            ddp.expect_backward(loss)
        self._backward_in_phase("step", loss, gradient, retain_graph)

    def _backward_in_phase(self, phase: str, loss: torch.Tensor, gradient: torch.Tensor | None,
                           retain_graph: bool | None) -> None:
        self._policy.phase = phase
        try:
            torch.autograd.backward(loss, gradient, retain_graph=retain_graph)
        finally:
            self._policy.phase = ""

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
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
        self._no_step_depth += 1
        try:
            yield
        finally:
            self._no_step_depth -= 1

    @property
    def step_incomplete(self) -> bool:
        """Whether a training step is half-applied: ``True`` from the first bucket stepped in a backward until
        that backward's end completes, and still ``True`` after a backward that raised (or was interrupted) in
        between, when some tensors were stepped on the batch and others not. Read-only."""
        return self._engine.incomplete

    @property
    def micro_batches(self) -> int:
        """Backwards accumulated since the last step (``0`` right after a step)."""
        return self._micro_batches

    @property
    def last_step(self) -> StepStats:
        """Telemetry of the last training step: grad norm, tensors stepped and skipped, overflow, step time."""
        return self._policy.stats

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Total norm of the gradients of the last step, measured inside backward before any step or clipping
        (the value ``clip_grad_norm_`` would have returned); ``None`` unless ``track_grad_norm=True`` or a
        global-norm ``max_grad_norm`` is set."""
        return self._policy.stats.grad_norm

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
    def accumulation_steps(self) -> int:
        """The configured ``accumulation_steps``: backwards per in-backward step."""
        return self._accumulation_steps

    @property
    def max_grad_norm(self) -> float | None:
        """The configured ``max_grad_norm`` (``None``: no norm clipping); see :meth:`configure_clipping`."""
        return self._policy_options["max_grad_norm"]

    @property
    def clip_mode(self) -> str:
        """The configured ``clip_mode``: ``"exact"``, ``"two_pass"``, ``"per_parameter"`` or ``"previous_norm"``."""
        return self._policy_options["clip_mode"]

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
        return self._policy_options["max_grad_value"]

    @property
    def grad_norm_type(self) -> float:
        """The configured ``grad_norm_type``."""
        return float(self._policy_options["grad_norm_type"])

    def configure_clipping(
        self,
        *,
        max_grad_norm: float | None | object = _UNCHANGED,
        clip_mode: str | object = _UNCHANGED,
        max_grad_value: float | None | object = _UNCHANGED,
        grad_norm_type: float | object = _UNCHANGED,
        grad_norm_order: Any = _UNCHANGED,
    ) -> None:
        """Change the clipping options between two steps, as if they had been given at construction (a framework
        adapter sets them from the framework's own setting). Options not given keep their value; the previous
        step's norm is kept. ``grad_norm_order=None`` goes back to the order the tensors were given in.

        Raises:
            ValueError: an option is out of range (as at construction).
            TypeError: ``grad_norm_order`` is not an ordered iterable of tensors or a module.
            RuntimeError: called during a backward.
        """
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("configure_clipping() was called during a backward; call it between two steps")
        changes = {
            k: v for k, v in (("max_grad_norm", max_grad_norm), ("clip_mode", clip_mode),
                              ("max_grad_value", max_grad_value), ("grad_norm_type", grad_norm_type))
            if v is not _UNCHANGED
        }
        options = {**self._policy_options, **changes}
        policy = GradPolicy(**options)
        _check_norms_over_kinds(options, [p for g in self.param_groups for p in g["params"]])
        _check_value_clipping(options, [p for g in self.param_groups for p in g["params"]])
        if grad_norm_order is not _UNCHANGED:
            self._norm_order = self._norm_order_of(grad_norm_order)
        old = self._policy
        policy.previous_norm, policy.stats = old.previous_norm, old.stats
        self._policy_options = options
        self._policy = policy
        self._rank_norms()

    def set_grad_multiplier(self, multiplier: float | torch.Tensor | None) -> None:
        """Multiply every gradient by ``multiplier`` before it is checked, clipped and stepped, from the next step
        on until set again (``None``: no scaling). It is what a loop that sums ``loss * num_tokens`` and then
        scales the gradients by ``1 / num_tokens`` before clipping does (torchtune's recipes); set it any time
        before the backward that steps, e.g. once the window's token count is known.

        Raises:
            ValueError: ``multiplier`` is not a finite number or a one-element floating tensor.
            RuntimeError: called during a backward.
        """
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("set_grad_multiplier() was called during a backward; call it between two steps")
        multiplier = GradPolicy.check_multiplier(multiplier)
        self._policy_options["grad_multiplier"] = self._policy.grad_multiplier = multiplier

    @property
    def grad_multiplier(self) -> float | torch.Tensor | None:
        """The multiplier set by :meth:`set_grad_multiplier` (``None``: none)."""
        return self._policy_options.get("grad_multiplier")

    def _check_still_single_process(self) -> None:
        """Once per backward: plain tensors accepted before a process group existed must not now step locally."""
        try:
            plain = [
                p for g in self.param_groups for p in g["params"] if id(p) not in self._ddp_param_ids
                and not is_dtensor(p)
            ]
            check_single_process(False, plain)
        except RuntimeError as e:
            raise RuntimeError(
                f"{e}. This optimizer was built before the process group existed; build it after wrapping the "
                "model (InBackwardOptimizer(ddp_model, ...))"
            ) from None

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
        """
        if self._finishing:
            self._run_post_hooks()
            return None
        self._framework_watch.at_step(self)
        self._check_steps_since_step()
        loss = None
        if closure is not None:
            if self._ddp_hook is not None or adapted_framework_above(sys._getframe(1)):
                with torch.enable_grad():
                    loss = closure()
            else:
                with torch.enable_grad(), self.no_step():
                    loss = closure()
        if any(p.grad is not None for g in self.param_groups for p in g["params"]):
            self._micro_batches = 0
            # one bucket of every tensor, unscaled/checked/clipped, then stepped or skipped, as in backward
            stepped = self._engine.step_standard(
                [(gi, list(g["params"])) for gi, g in enumerate(self.param_groups) if g["params"]]
            )
            self._policy.end(self)
            if stepped:
                self._run_post_hooks()
        return loss

    step.hooked = True  # type: ignore[attr-defined]  # we fire step hooks ourselves, once per training step

    def _check_steps_since_step(self) -> None:
        n, self._backward_steps_since_step = self._backward_steps_since_step, 0
        if n <= 1 or (self._warned_several_steps and not self._strict):
            return
        message = (
            f"{n} backwards each ran a full optimizer step since the last step() call: this optimizer steps inside "
            "every backward (accumulation_steps=1), so a loop that accumulates gradients "
            f"over {n} micro-batches before calling step() made {n} optimizer steps instead of one. Pass "
            f"accumulation_steps={n}, or run the micro-batches that only accumulate inside `with opt.no_step():`, "
            "or use the framework's adapter in dist_optim.integrations"
        )
        if self._strict:
            raise RuntimeError(f"{message} (strict=True)")
        self._warned_several_steps = True
        warnings.warn(f"{message}; strict=True raises this instead", UserWarning, stacklevel=3)

    def _check_unowned_grads(self) -> None:
        """Once per optimizer: a parameter of the module that no optimizer steps in backward (frozen at
        construction, unfrozen since) got a gradient, which would grow forever."""
        index = self._engine.index_of
        for name, ref in self._frozen:
            p = ref()
            if p is not None and p.grad is not None and id(p) not in index and not is_owned(p):
                self._frozen = []
                warnings.warn(
                    f"parameter {name} got a gradient but no optimizer steps it (it did not require grad when this "
                    "optimizer was built, from the module): it is never trained and its .grad grows with every "
                    "backward. Build the optimizer after unfreezing it, or add it with opt.add_param_group",
                    UserWarning,
                    stacklevel=2,
                )
                return

    def _run_post_hooks(self) -> None:
        for hook in chain(self._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            hook(self, (), {})

    # -- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``optimizer_class``'s state dict format. With ``clip_mode="previous_norm"`` after a step, one more key,
        ``"in_backward"``, holds the previous step's gradient norm, which the next step clips with (torch's
        ``load_state_dict`` ignores it)."""
        own = self._own("state_dict")
        if own is None:
            state_dict = super().state_dict()
        else:  # the class's own format (bitsandbytes nests its quantised state), with this optimizer's hooks
            for pre_hook in self._optimizer_state_dict_pre_hooks.values():
                pre_hook(self)
            shell = self._shell(own)
            state_dict = own.state_dict(shell)
            for post_hook in self._optimizer_state_dict_post_hooks.values():
                result = post_hook(self, state_dict)
                state_dict = state_dict if result is None else result
        extra = self._policy.extra_state()  # a collective for a DTensor norm: state_dict() is called on every rank
        if extra:
            state_dict["in_backward"] = extra
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict written by this class or by ``optimizer_class`` itself (same format)."""
        own = self._own("load_state_dict")
        if own is None:
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "in_backward"})
        else:  # the class's own load (bitsandbytes keeps uint8 codes; pytorch-optimizer restores dtypes)
            loaded = {k: v for k, v in state_dict.items() if k != "in_backward"}
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, loaded)
                loaded = loaded if result is None else result
            shell = self._shell(own)
            own.load_state_dict(shell, loaded)
            self.state, self.param_groups = shell.state, shell.param_groups
            for post_hook in self._optimizer_load_state_dict_post_hooks.values():
                post_hook(self)
        self._convert_loaded_state()
        self._recipe.choose_kernels()
        self._engine.rebuild()
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None:
            self._policy.load_extra_state(state_dict.get("in_backward") or {}, like=first)

    def _own(self, method: str) -> type[torch.optim.Optimizer] | None:
        """The optimizer class, if this optimizer has one class and it overrides ``torch.optim``'s ``method``."""
        classes = set(self._recipe.classes)
        if len(classes) != 1:
            return None
        cls = classes.pop()
        return cls if getattr(cls, method) is not getattr(torch.optim.Optimizer, method) else None

    def _shell(self, cls: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """An instance of ``cls`` built as the standard loop builds it (its own attributes), holding this
        optimizer's live groups and state, for the class's own ``state_dict``/``load_state_dict``."""
        with no_rng([p for g in self.param_groups for p in g["params"]]):
            shell = cls([{**hyperparameters(g), "params": g["params"]} for g in self.param_groups],
                        **self._recipe.kwargs_for(cls))
        shell.state, shell.param_groups = self.state, self.param_groups
        return shell

    def _convert_loaded_state(self) -> None:
        """Let each group's optimizer class bring loaded state and groups to its current format, as its own
        ``__setstate__`` does in ``load_state_dict`` (older checkpoints hold ``step`` as a plain number, which the
        kernels refuse); ours is ``Optimizer.__setstate__``, which converts nothing."""
        for cls in dict.fromkeys(self._recipe.classes):
            groups = [g for c, g in zip(self._recipe.classes, self.param_groups) if c is cls]
            state = {p: self.state[p] for g in groups for p in g["params"] if p in self.state}
            shell = cls.__new__(cls)  # the class's own conversion, run on our groups and state dicts in place
            cls.__setstate__(shell, {"defaults": dict(self.defaults), "state": state, "param_groups": groups})

    def remove(self) -> None:
        """Detach every hook, and let the parameters go of this optimizer (until then they keep it alive, so that
        dropping the last reference to it does not stop training). The model then trains with a standard
        optimizer again, and this object behaves as one: :meth:`step` steps whatever gradients are present."""
        if self._ddp_hook is not None:
            raise NotImplementedError(
                "cannot detach from a DistributedDataParallel model: DDP keeps its communication hook for its "
                "lifetime. Wrap the module in a new DDP to train it with a standard optimizer"
            )
        self._engine.remove()
        self._backward_steps_since_step = 0  # from now on step() is the step
        release((p for g in getattr(self, "param_groups", []) for p in g["params"]), self)


class _EngineOwner:
    """The optimizer as its engine sees it (``dist_optim._engine.Owner``): the training step's edges."""

    __slots__ = ("opt",)

    def __init__(self, opt: InBackwardOptimizer) -> None:
        self.opt = opt

    def backward_steps(self) -> bool:
        steps = self.opt._backward_steps()
        if steps:
            self.opt._framework_watch.at_backward(self.opt)
        return steps

    def grad_policy(self) -> GradPolicy:
        return self.opt._policy

    def param_name(self, p: torch.Tensor) -> str:
        return self.opt.param_name(p)

    def step_begins(self) -> None:
        opt = self.opt
        for hook in chain(_global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()):
            hook(opt, (), {})

    def bucket_stepped(self, params: list[torch.Tensor]) -> None:
        opt = self.opt
        for hook in opt._bucket_step_hooks.values():
            hook(opt, params)

    def step_ends(self, stepped: bool) -> None:
        opt = self.opt
        opt._policy.end(opt)
        opt._check_unowned_grads()
        if stepped:
            if opt._accumulation_steps == 1:  # with k > 1, a step() that flushes a partial window is meant
                opt._backward_steps_since_step += 1
            # Through the public step(), so that wrappers installed on it (LR schedulers) see the step happen.
            opt._finishing = True
            try:
                opt.step()
            finally:
                opt._finishing = False


def _check_value_clipping(options: dict[str, Any], params: list[torch.Tensor]) -> None:
    """``max_grad_value`` clamps each gradient in place, which DTensor refuses on a ``Partial`` gradient (a
    SequenceParallel norm's, under tensor parallel without FSDP2), as ``clip_grad_value_`` fails on it in the standard
    loop: refused before anything steps, for every replicated DTensor parameter (whose gradient may be Partial; only
    the backward would tell)."""
    if options["max_grad_value"] is None:
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


def _check_norms_over_kinds(options: dict[str, Any], params: list[torch.Tensor]) -> None:
    """Gradient norms over DTensors and plain tensors together (plain norms next to a tensor-parallel model, with
    allow_local_steps) fail in DTensor's foreach norm, as ``clip_grad_norm_`` does on them: refused before anything
    steps instead of in the middle of a backward."""
    measures = (options["track_grad_norm"] or options["max_grad_norm"] is not None
                or options["nonfinite"] != "ignore")
    if not measures or not params:
        return
    kinds = {is_dtensor(p) for p in params}
    if len(kinds) > 1:
        raise NotImplementedError(
            "gradient norms (max_grad_norm, track_grad_norm or nonfinite checks) over plain tensors next to DTensor "
            "ones (plain parameters in a tensor-parallel model, stepped with allow_local_steps=True): DTensor's norm "
            "refuses the mix, as torch.nn.utils.clip_grad_norm_ does. Parallelize those parameters too "
            "(SequenceParallel for norms) so that every parameter is a DTensor"
        )


def _first_tensor(groups: list[Any]) -> torch.Tensor:
    """The first tensor given (its dtype and device build the probe of the class's defaults), else an empty one."""
    first = next((p for g in groups if isinstance(g, dict) for p in g.get("params", [])), None)
    if isinstance(first, tuple):
        first = first[1]
    return first if isinstance(first, torch.Tensor) else torch.empty(0)


def _warn_fused_with_uneven_scale(scaler: Any, kernels: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """``scaler.step(opt)`` lets a fused kernel unscale the gradients itself (``grad / scale`` inside the kernel);
    in backward they are unscaled before the step (``grad * (1 / scale)``, as ``scaler.unscale_`` does). Both are
    exact while the scale is a power of two, as GradScaler's defaults keep it; other factors make them differ in
    the last bit, which is said once here rather than left silent."""
    if scaler is None or not scaler.is_enabled():
        return
    factors = {"init_scale": scaler._init_scale, "growth_factor": scaler._growth_factor,
               "backoff_factor": scaler._backoff_factor}
    uneven = {k: v for k, v in factors.items() if math.frexp(float(v))[0] != 0.5}
    fused = any(k.get("fused") or g.get("fused") for k, g in zip(kernels, groups))
    if uneven and fused:
        warnings.warn(
            f"grad_scaler has {', '.join(f'{k}={v}' for k, v in uneven.items())}, not a power of two, and the "
            "optimizer runs a fused kernel: scaler.step(opt) would let that kernel unscale the gradients itself, "
            "which rounds differently from unscaling them before the step as the in-backward step does, so results "
            "differ from scaler.step's in the last bit. Use powers of two (GradScaler's defaults), or foreach=True, "
            "whose scaler.step unscales first too",
            UserWarning,
            stacklevel=3,
        )


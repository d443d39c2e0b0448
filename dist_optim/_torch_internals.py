"""Every private torch name dist_optim uses, in one place.

Each entry says what it is for and which public API would replace it ("public: none yet" where torch has none).
``tests/test_torch_internals.py`` resolves each one on the installed torch and fails naming the entry and what it
guards, so that a torch upgrade that moves one is caught by name, never by a guard that quietly stops firing.

What is bound at import (functions, ops, classes) is imported by name where it is used: the hot paths (the
per-parameter hook, the stepper) call torch's object directly, with no call layer of ours in between. An attribute
read on a torch object is a function here, or its name as a constant where the caller needs ``getattr`` with a
default; ``local_tensor`` is an ``operator.attrgetter`` (a C call, no Python frame).

Not torch privates, so not here: ``param._in_backward_optimizers``, ``param._optimizer_classes`` and
``param._optimizer_kwargs`` (``dist_optim.parallel._seed_pair``) are the seed pair's own public contract, the layout of
torch's private ``_apply_optimizer_in_backward`` that it reproduces and torch's DDP reads; the private names of
other packages (torchtune's recipe) stay with their adapters. Docstrings and messages elsewhere may name a torch
private for the reader (the DDP reducer method a torch lacks); code reaches one only through this module.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
from typing import Any

import torch

# -- the memory planner (fake tensors, dispatch, pytrees) -----------------------------------------------------------
# FakeTensorMode: tensors with shapes and no data, on which the planner traces a step; is_fake: the engine skips a
# value comparison that fake tensors cannot make; unset_fake_temporarily: the planner runs a device mesh's rank
# tensors (real) outside it, which FSDP2 over a tensor-parallel mesh slices on fake tensors. Public: none yet.
from torch._subclasses.fake_tensor import (
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.optim import optimizer as _optimizer
from torch.utils import _foreach_utils

# Every operator's outputs, as they are made: the planner's memory trace. Public: none yet.
from torch.utils._python_dispatch import TorchDispatchMode

# The tensors among an operator's outputs, and of a batch. Public: none yet.
from torch.utils._pytree import tree_iter, tree_leaves

__all__: list[str] = []

# -- the autograd engine ------------------------------------------------------------------------------------------
# The id of the backward running on this thread (-1 outside any): tells one backward from the next, and whether a
# call comes from inside a backward. Public: none yet.
graph_task_id = torch._C._current_graph_task_id

# Queue a callback that runs when the current backward ends: the engine's end-of-backward settling. Public: none yet
# (torch.autograd.graph has no end-of-backward callback).
queue_callback = torch.autograd.Variable._execution_engine.queue_callback

# A tensor's post-accumulate-grad hooks in registration order (an OrderedDict, for getattr with a default): the
# warning that a user's hook registered after ours sees a freed gradient. Public: none yet.
POST_ACCUMULATE_GRAD_HOOKS = "_post_accumulate_grad_hooks"

# The frame through which every backward launched from Python enters the engine (function name, the file it is in,
# and its local holding the tensors the backward starts from): the nested/reentrant-backward refusal and the
# retained-graph guard find the running backward and its roots on the stack. Public: none yet.
ENGINE_RUN_BACKWARD = ("_engine_run_backward", os.path.join("autograd", "graph.py"), "t_outputs")
# Where that frame holds the backward's retain_graph: torch.autograd.backward and torch.autograd.grad pass it as the
# second of the positional arguments after the roots. The guard of a retained graph that stepped reads it, to mark
# the graph's nodes only when the graph outlives the backward. Public: none yet.
ENGINE_RUN_BACKWARD_RETAIN_GRAPH = ("args", 1)

# The frame of ``BackwardCFunction.apply``, which runs an autograd Function's backward: a backward entry above it on
# the stack is a backward inside a backward (a reentrant checkpoint). Public: none yet.
BACKWARD_FUNCTION_APPLY = ("apply", os.path.join("autograd", "function.py"))

# A Python autograd Function's graph node names its Function class here: bucket learning finds reentrant checkpoint
# segments (``CheckpointFunction``) in the graph. Public: none yet.
FORWARD_CLS = "_forward_cls"


# -- torch.optim ----------------------------------------------------------------------------------------------------
# The hook registries of torch.optim.Optimizer (global, and per optimizer): the facade runs each step's hooks once
# per training step, and the state-dict hooks around its own state dict. Public: none yet (registration only).
def global_step_pre_hooks() -> dict[int, Any]:
    return _optimizer._global_optimizer_pre_hooks


def global_step_post_hooks() -> dict[int, Any]:
    return _optimizer._global_optimizer_post_hooks


def step_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_step_pre_hooks


def step_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_step_post_hooks


def state_dict_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_state_dict_pre_hooks


def state_dict_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_state_dict_post_hooks


def load_state_dict_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_load_state_dict_pre_hooks


def load_state_dict_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_load_state_dict_post_hooks


# torch.optim.Optimizer wraps each class's step once in ``profile_hook_step`` (which fires the step hooks) and marks
# the wrapper ``hooked``; a step already marked is left alone. The facade fires its hooks itself, and inner
# optimizers step through the unwrapped step, so that hooks fire once per training step. Public: none yet.
def fires_own_step_hooks(step: Any) -> Any:
    step.hooked = True
    return step


def unwrap_profiled_step(step: Any) -> Any:
    return step.__wrapped__ if getattr(step, "hooked", False) else step


# The mark torch's LR schedulers set on an optimizer whose step ran (``optimizer._opt_called``, for their "step()
# before optimizer.step()" warning): not one of a class's own counters. Public: none yet.
LR_SCHEDULER_STEP_MARK = "_opt_called"


# -- GradScaler ---------------------------------------------------------------------------------------------------
# The scaler's growth and backoff settings: the warning that an uneven factor makes a fused kernel's own unscaling
# round differently. Public: none yet (get_scale() is the scale alone).
def scaler_factors(scaler: torch.amp.GradScaler) -> dict[str, float]:
    return {"init_scale": scaler._init_scale, "growth_factor": scaler._growth_factor,
            "backoff_factor": scaler._backoff_factor}


# The scale tensor scaler.scale(loss) set, without a device sync (get_scale() syncs): unscaling in backward.
# Public: get_scale(), which returns a float.
def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    return scaler._scale


# Leave the scaler as scaler.unscale_(optimizer) would, with an inf check made in backward, so that update() and
# scaler.step(optimizer) carry on. Public: none yet (unscale_ does the check itself, on the whole optimizer).
def mark_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.UNSCALED


# GradScaler's own kernel: unscale a device's gradients and record a non-finite value. Public: scaler.unscale_,
# on a whole optimizer only.
amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_

# -- kernels --------------------------------------------------------------------------------------------------------
# Each tensor's norm, by clip_grad_norm_'s kernel (the global norm combines them as it does). Public: none yet
# (torch.nn.utils.get_total_norm returns the total only).
foreach_norm = torch._foreach_norm

# The fused Adam/AdamW kernels and the step-count increment torch.optim calls before them: the bucket's fused step
# without torch's per-tensor Python work. Public: Adam(fused=True).step(), which does that work.
foreach_add_ = torch._foreach_add_
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_

# Group tensor lists by device and dtype, as clip_grad_norm_ and AveragedModel do: the same kernels in the same
# order as the standard loop. Public: none yet.
group_tensors_by_device_and_dtype = _foreach_utils._group_tensors_by_device_and_dtype

# The device types that have foreach kernels, as AveragedModel.update_parameters asks. Public: none yet.
foreach_supported_devices = _foreach_utils._get_foreach_kernels_supported_devices

# -- tensors ----------------------------------------------------------------------------------------------------------
# A DTensor's local shard, without an autograd op: elementwise optimizers step the shards directly.
# Public: DTensor.to_local(), which records an autograd op on every call.
LOCAL_TENSOR = "_local_tensor"
local_tensor = operator.attrgetter(LOCAL_TENSOR)


# A tensor's version counter (-1 for an inference tensor, which has none): averaging reads n_averaged again, with a
# device sync, only when it changed. Public: none yet.
def tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:
        return -1


# -- DistributedDataParallel -------------------------------------------------------------------------------------------
# Which parameters any rank used in the last backward (summed by DDP's finalize), with find_unused_parameters or
# static_graph: a bucket with a parameter unused on this rank waits for it. Public: none yet.
def has_local_used_map(reducer: Any) -> bool:
    return hasattr(reducer, "_get_local_used_map")


def local_used_map(reducer: Any) -> torch.Tensor:
    return reducer._get_local_used_map()


# Tell DDP's reducer that an optimizer steps in backward, so that it does not write the gradients back to .grad at
# the end of backward. Public: none yet.
def skip_grad_writeback(reducer: Any) -> None:
    getattr(reducer, SKIP_GRAD_WRITEBACK)()


# Whether DDP has rebuilt its buckets from the first iteration's gradient order: two_pass's second backward must not
# be recorded twice in that order. Public: none yet.
def ddp_rebuilt_buckets(ddp: Any) -> bool:
    return getattr(ddp, DDP_REBUILT_BUCKETS, False)


# The names of those two on DDP and its reducer, which the memory planner's stand-in for DDP carries
# (dist_optim._planner._layouts.PlannedDDP). Public: none yet.
DDP_REBUILT_BUCKETS = "_has_rebuilt_buckets"
SKIP_GRAD_WRITEBACK = "_set_optimizer_in_backward"


# DDP's bucket assignment by size (the reducer's own: in the given order, each bucket closed once it reaches its
# limit) and its first bucket's limit at the default bucket_cap_mb: the planner's stand-in lays out its buckets as
# DDP does (plan(parallel="ddp")). Public: none yet.
def ddp_bucket_assignment(tensors: list[torch.Tensor], limits: list[int], order: list[int] | None = None
                          ) -> list[list[int]]:
    import torch.distributed as dist

    return dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors), order or [])[0]


def ddp_first_bucket_bytes() -> int:
    import torch.distributed as dist

    return int(dist._DEFAULT_FIRST_BUCKET_BYTES)


# The store of torch's fake process group, over which the memory planner runs FSDP2's own code for one rank of N
# (plan(parallel="fsdp2")). Public: none yet.
def fake_store() -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# DTensor's sharding propagation caches each operator's output spec, keyed by its inputs' specs, and a DeviceMesh
# compares equal to any mesh over the same ranks and dimension names, whatever its process groups: after
# destroy_process_group() and a new init_process_group() in one process, a DTensor made for the new mesh (by
# fully_shard, distribute_tensor) comes out on the old mesh, whose groups are gone or are others now. Cleared when a
# process group this process made (the trainer's, the planner's fake one) is destroyed. Public: none yet (torch
# names it a debugging aid: torch.distributed.tensor.debug).
def clear_sharding_cache() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's


# -- FSDP2 (fully_shard) --------------------------------------------------------------------------------------------
# A fully_shard-ed module's parameter groups (each with its FSDPParams): whether unsharded gradients accumulated
# without gradient sync wait for the next synced backward (two_pass). Public: none yet.
def fsdp_param_groups(unit: Any) -> list[Any]:
    return unit._get_fsdp_state()._fsdp_param_groups


# The tensors whose storages FSDP2 resizes in place, of every fully_shard-ed module in ``module``: each FSDPParam's
# all-gather outputs (which its unsharded parameter views) and an all-gather extension's unsharded inner tensors,
# allocated at the copy-out after an all-gather and freed at reshard (``alloc_storage``/``free_storage``). No
# operator reports a storage resize, so the memory planner's trace re-reads these storages' sizes at every operator
# it sees. Made at the first all-gather. Public: none yet.
def fsdp_resized_tensors(module: Any) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in fsdp_param_groups(m):
                for fp in group.fsdp_params:
                    out += [*fp.all_gather_outputs, *fp._unsharded_inner_tensors]
    return out


# The dispatcher's operators under FSDP2's all-gather (``all_gather_into_tensor``) and reduce-scatter
# (``reduce_scatter_tensor``) on a process group: the memory planner adds gloo's buffers for their duration.
# Public: none (``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor`` call them).
def fsdp_collective_ops() -> tuple[Any, Any]:
    return torch.ops.c10d._allgather_base_.default, torch.ops.c10d._reduce_scatter_base_.default


# An FSDPParam's unsharded parameter (made at its first all-gather), for getattr with a default. Public: none yet.
UNSHARDED_PARAM = "_unsharded_param"

# -- FSDP1 ------------------------------------------------------------------------------------------------------------
# The mark FSDP1 sets on the parameters it flattens (torch's FSDP_FLATTENED): the seed pair leaves the step of an
# original parameter (use_orig_params=True) to FSDP1. Public: none yet.
FSDP_FLATTENED = "_fsdp_flattened"


# FSDP1's flat parameter (use_orig_params=False), which is not an original parameter. Public: none yet.
def flat_parameter_class() -> type:
    from torch.distributed.fsdp._flat_param import FlatParameter

    return FlatParameter


# -- pipelining -----------------------------------------------------------------------------------------------------
# A schedule's micro-batch count: the optimizers' divisor and accumulation. Public: none yet (a constructor argument).
def n_microbatches(schedule: Any) -> int:
    return schedule._n_microbatches


# The stages a schedule runs on this rank (``_stages`` on multi-stage schedules, ``_stage`` on single-stage ones):
# one optimizer per stage. Public: none yet.
def schedule_stages(schedule: Any) -> list[Any] | None:
    stages = getattr(schedule, "_stages", None)
    if stages is None and getattr(schedule, "_stage", None) is not None:
        stages = [schedule._stage]
    return stages


def is_schedule(schedule: Any) -> bool:
    return hasattr(schedule, "_n_microbatches")


# The stage method the schedule calls after a stage's last backward to reduce an FSDP2 stage's gradients: pipeline x
# FSDP2 steps each bucket there (torch 2.10 and later). Public: none yet (undocumented, unprefixed).
PERFORM_REDUCE_GRAD = "perform_reduce_grad"

# The warm-up exchange a PipelineStage runs at its first step (a vote sent through the stages, read back with
# .item()): the memory planner's stage, on a fake group whose receives carry no values, replaces both methods and
# gives every shape instead. Public: none yet (input_args/output_args make the vote "static", not skipped).
STAGE_WARMUP_VOTE = "_warmup_forward_vote"
STAGE_WARMUP_RESULT = "_warmup_backward_result"


# What a stage keeps from one schedule step to the next, for the memory planner's resident bytes: the receive
# buffers of every micro-batch (activations and gradients, allocated at its first step) with the gradients backward
# left on them, and the last stage's outputs (kept to merge, cleared at the next step). Public: none yet.
def stage_recv_buffers(stage: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the buffers receiving activations, those receiving gradients and the gradients left on the former)."""
    def buffers(infos: Any) -> list[torch.Tensor]:
        return [i.buffer for per_mb in infos for i in per_mb if not i.is_root_arg and i.buffer is not None]
    acts = buffers(stage.args_recv_info.values())
    return acts, buffers(stage.grad_recv_info.values()) + [b.grad for b in acts if b.grad is not None]


def stage_kept_outputs(stage: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(stage.output_chunks) if isinstance(t, torch.Tensor)]


# -- names that wrappers put in module paths ---------------------------------------------------------------------------
# torch.compile's OptimizedModule (_orig_mod), activation checkpointing's CheckpointWrapper
# (_checkpoint_wrapped_module) and FSDP1 (_fsdp_wrapped_module): a checkpoint's names are the same whatever wrapped
# the model. Public: none yet.
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

# How a pickle names a torch.layout (torch.layout.__reduce__): checkpoint metadata is unpickled with an allowlist.
# Public: none yet.
PICKLED_LAYOUT = ("torch.serialization", "_get_layout")

# -- torch.compile ---------------------------------------------------------------------------------------------------
# dynamo's limits on how many graphs one function may compile (per code object, and in all): a function compiled
# once with static shapes meets one shape per tensor of a model (torchao's Adam step, which torchao's own step runs
# under the same lifted limits), and past the limit dynamo would run it uncompiled, other bits than the standard
# loop's. Public: none yet (torch._dynamo.config is not a documented API).
def dynamo_recompile_limit_lifted() -> contextlib.AbstractContextManager[None]:
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=sys.maxsize, accumulated_recompile_limit=sys.maxsize)


# -- compiled autograd -----------------------------------------------------------------------------------------------
# What a user turns compiled autograd on with, named in the refusal. Public: none yet.
COMPILED_AUTOGRAD_SWITCHES = ("torch._dynamo.config.compiled_autograd = True",
                              "torch._dynamo.compiled_autograd._enable")


# Whether compiled autograd traces this backward (it would trace the hooks away): read from sys.modules, never
# imported (importing dynamo costs seconds). Public: none yet.
def compiled_autograd_on() -> bool:
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


# Whether compiled autograd is configured on for the next torch.compile (refused at construction). Public: none yet.
def compiled_autograd_configured() -> bool:
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and bool(dynamo.config.compiled_autograd)

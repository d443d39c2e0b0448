"""Every entry of dist_optim/_torch_internals.py, resolved on the installed torch: one test per entry, failing with
the entry's name and what stops working without it, so that a torch upgrade that moves a private name is caught by
name and no guard switches off in silence. Where a name could stay and change meaning (a frame the refusals look
for, a flag, a mark torch sets), the check also runs what the entry is used for. The entries that need a process
group (DTensor, DDP, FSDP2, pipelining) are checked on one gloo rank.

A new entry in the module without a check here fails ``test_every_entry_has_a_check``.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import types
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn


class _Internals:
    """dist_optim._torch_internals, imported when first used: a torch that moved one of its module-level names fails
    its import, and each test first resolves its own entry's torch name, so the moved one is the one named."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("dist_optim._torch_internals"), name)


internals = _Internals()


def _resolve(dotted: str):
    """The object at ``dotted`` (a module path, then attributes), importing the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


# -- the autograd engine ------------------------------------------------------------------------------------------
def _check_graph_task_id() -> None:
    _resolve("torch._C._current_graph_task_id")
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda t: seen.append(internals.graph_task_id()))
    assert internals.graph_task_id() == -1
    (x * 2).sum().backward()
    (x * 2).sum().backward()
    assert len(seen) == 2 and -1 not in seen and seen[0] != seen[1], seen


def _check_queue_callback() -> None:
    _resolve("torch.autograd.Variable._execution_engine.queue_callback")
    order = []
    x = torch.ones(2, requires_grad=True)

    def hook(t: torch.Tensor) -> None:
        order.append("hook")
        internals.queue_callback(lambda: order.append("end"))

    x.register_post_accumulate_grad_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "end"], order


def _check_post_accumulate_grad_hooks() -> None:
    x = torch.ones(2, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda t: None)
    last = x.register_post_accumulate_grad_hook(lambda t: None)
    hooks = getattr(x, internals.POST_ACCUMULATE_GRAD_HOOKS)
    assert next(reversed(hooks)) == last.id, "the hooks are not kept in registration order"


def _check_engine_run_backward() -> None:
    name, file, roots = internals.ENGINE_RUN_BACKWARD
    code = _resolve(f"torch.autograd.graph.{name}").__code__
    assert code.co_filename.endswith(file) and roots in code.co_varnames[:code.co_argcount], (code, code.co_varnames)
    from dist_optim.engine._guards import backward_frames

    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda t: seen.append(backward_frames()))
    loss = (x * 2).sum()
    loss.backward()
    (nested, found, retained), = seen
    assert not nested and len(found) == 1 and found[0] is loss, "the backward's roots are not found on the stack"
    assert not retained, "a backward that frees its graph was read as retaining it"


def _check_engine_run_backward_retain_graph() -> None:
    from dist_optim.engine._guards import backward_frames

    name, _, _ = internals.ENGINE_RUN_BACKWARD
    args, at = internals.ENGINE_RUN_BACKWARD_RETAIN_GRAPH
    code = _resolve(f"torch.autograd.graph.{name}").__code__
    assert code.co_flags & inspect.CO_VARARGS and code.co_varnames[code.co_argcount] == args, code.co_varnames
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda t: seen.append(backward_frames()[2]))
    loss = (x * 2).sum()
    loss.backward(retain_graph=True)
    torch.autograd.grad((x * 3).sum(), x, retain_graph=True)  # no hook runs: grad() does not accumulate
    loss.backward()
    assert seen == [True, False], f"retain_graph is not args[{at}] of the backward's frame: {seen}"


def _check_backward_function_apply() -> None:
    name, file = internals.BACKWARD_FUNCTION_APPLY
    code = getattr(_resolve("torch.autograd.function.BackwardCFunction"), name).__code__
    assert code.co_filename.endswith(file), code
    from dist_optim.engine._guards import backward_frames

    seen = []
    layer = nn.Linear(2, 2)
    layer.weight.register_post_accumulate_grad_hook(lambda t: seen.append(backward_frames()[0]))
    x = torch.ones(1, 2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert seen == [True], f"a reentrant checkpoint's backward was not seen as nested: {seen}"


def _check_forward_cls() -> None:
    from dist_optim.engine._guards import REENTRANT_CHECKPOINT

    x = torch.ones(1, 2, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(nn.Linear(2, 2), x, use_reentrant=True)
    assert getattr(out.grad_fn, internals.FORWARD_CLS, None) is REENTRANT_CHECKPOINT, out.grad_fn


# -- torch.optim ----------------------------------------------------------------------------------------------------
def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _check_global_hooks(entry: str, register: str) -> Callable[[], None]:
    def check() -> None:
        handle = _resolve(f"torch.optim.optimizer.{register}")(lambda *a: None)
        try:
            assert handle.id in getattr(internals, entry)(), f"{register} does not register in {entry}()"
        finally:
            handle.remove()

    return check


def _check_optimizer_hooks(entry: str, register: str) -> Callable[[], None]:
    def check() -> None:
        opt = _sgd()
        handle = getattr(opt, register)(lambda *a: None)
        assert handle.id in getattr(internals, entry)(opt), f"opt.{register} does not register in {entry}(opt)"

    return check


def _check_step_wrapper() -> None:
    class Plain(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    original = Plain.step
    Plain([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert Plain.step is not original and internals.unwrap_profiled_step(Plain.step) is original, (
        "torch no longer wraps a class's step in a marked profile_hook_step")

    class Own(torch.optim.SGD):
        @internals.fires_own_step_hooks
        def step(self, closure=None):
            return super().step(closure)

    original = Own.step
    Own([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert Own.step is original, "torch wrapped a step marked as firing its own hooks"


def _check_lr_scheduler_mark() -> None:
    opt = _sgd()
    torch.optim.lr_scheduler.StepLR(opt, 1)
    opt.step()
    assert getattr(opt, internals.LR_SCHEDULER_STEP_MARK, False) is True, sorted(vars(opt))


# -- GradScaler ---------------------------------------------------------------------------------------------------
def _scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


def _check_scaler_factors() -> None:
    factors = internals.scaler_factors(_scaler(init_scale=3.0, growth_factor=5.0, backoff_factor=0.25))
    assert factors == {"init_scale": 3.0, "growth_factor": 5.0, "backoff_factor": 0.25}, factors


def _check_scaler_scale() -> None:
    scaler = _scaler(init_scale=4.0)
    assert internals.scaler_scale(scaler) is None
    scaler.scale(torch.ones(()))
    scale = internals.scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 4.0, scale


def _check_mark_unscaled() -> None:
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = _scaler(init_scale=4.0, backoff_factor=0.5)
    scaler.scale((p * 2).sum()).backward()
    internals.mark_unscaled(scaler, opt, torch.ones(()))  # an overflow found in backward
    scaler.step(opt)  # skipped: the inf check says an overflow
    scaler.update()
    assert torch.equal(p.detach(), torch.zeros(1)) and scaler.get_scale() == 2.0, (p, scaler.get_scale())


def _check_amp_unscale() -> None:
    grads, found = [torch.tensor([2.0]), torch.tensor([float("inf")])], torch.zeros(())
    internals.amp_unscale_(grads, found, torch.tensor(0.5))
    assert grads[0].item() == 1.0 and found.item() == 1.0, (grads, found)


# -- tensors ----------------------------------------------------------------------------------------------------------
def _check_tensor_version() -> None:
    t = torch.zeros(1)
    before = internals.tensor_version(t)
    t.add_(1)
    assert internals.tensor_version(t) == before + 1
    with torch.inference_mode():
        assert internals.tensor_version(torch.zeros(1)) == -1


def _check_fake() -> None:
    with internals.FakeTensorMode():
        t = torch.zeros(2)
    assert internals.is_fake(t) and not internals.is_fake(torch.zeros(2))


def _check_unset_fake() -> None:
    real = torch.arange(4)
    with internals.FakeTensorMode():
        with internals.unset_fake_temporarily():
            out = real.view(2, 2)[1]
        fake = torch.zeros(2)
    assert not internals.is_fake(out) and out.tolist() == [2, 3] and internals.is_fake(fake)


def _check_ddp_buckets() -> None:
    import torch.distributed as dist

    assert internals.ddp_first_bucket_bytes() == dist._DEFAULT_FIRST_BUCKET_BYTES > 0
    tensors = [torch.empty(300_000), torch.empty(10), torch.empty(200_000)]  # 1.2 MB, then 0.8 MB
    assert internals.ddp_bucket_assignment(tensors, [2**20, 2**21], [0, 1, 2]) == [[0], [1, 2]]
    assert internals.ddp_bucket_assignment(tensors, [2**40]) == [[0, 1, 2]]


def _check_fake_store() -> None:
    import torch.distributed as dist

    assert isinstance(internals.fake_store(), dist.Store)


def _check_clear_sharding_cache() -> None:
    # two equal meshes (a second one over the same ranks, as a second job makes): an operator on the second one's
    # tensors comes out on the first, from DTensor's cache; cleared, on its own
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_optim._planner._fsdp2 import fake_group

    with fake_group(2) as first:
        second = init_device_mesh("cpu", (2,))
        assert first == second and first is not second
        a = distribute_tensor(torch.ones(4, 4), first, [Shard(0)])
        b = distribute_tensor(torch.ones(4, 4), second, [Shard(0)])
        assert (a + a).device_mesh is first and (b + b).device_mesh is first  # what the cache does
        internals.clear_sharding_cache()
        assert (b + b).device_mesh is second


def _check_fsdp_resized_tensors() -> None:
    # on torch's fake process group (2 ranks, this one rank 0), as the planner runs FSDP2
    from torch.distributed.fsdp import fully_shard

    from dist_optim._planner._fsdp2 import fake_group

    with fake_group(2) as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()  # the first all-gather makes the all-gather outputs
        resized = internals.fsdp_resized_tensors(model)
        assert len(resized) == 3, f"{len(resized)} resized tensors for 3 parameters"
        assert all(t.untyped_storage().size() == 0 for t in resized), "not freed at reshard"
        for unit in (model[0], model):  # FSDP2 resizes these storages to the unsharded parameters' bytes
            unit.unshard()
        assert sorted(t.untyped_storage().size() for t in resized) == [16, 64, 64]
        for unit in (model[0], model):
            unit.reshard()
        assert all(t.untyped_storage().size() == 0 for t in resized), "not freed at reshard"


def _check_fsdp_collective_ops() -> None:
    # what dist.all_gather_into_tensor and dist.reduce_scatter_tensor dispatch to, on torch's fake process group
    import torch.distributed as dist

    from dist_optim._planner._fsdp2 import fake_group

    seen = []

    class Ops(internals.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with fake_group(2), Ops():
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
    assert list(internals.fsdp_collective_ops()) == [f for f in seen if "c10d" in str(f)], seen


def _check_dispatch_and_pytree() -> None:
    seen = []

    class Seen(internals.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(t for t in internals.tree_iter(out) if isinstance(t, torch.Tensor))
            return out

    with Seen():
        torch.ones(2).max(0)
    assert len(seen) >= 2, seen  # values and indices
    assert len(internals.tree_leaves({"a": [torch.ones(1), (torch.ones(1),)]})) == 2


# -- DDP's reducer -----------------------------------------------------------------------------------------------------
def _check_reducer(method: str) -> Callable[[], None]:
    def check() -> None:
        assert hasattr(_resolve("torch._C._distributed_c10d.Reducer"), method), f"Reducer.{method}"

    return check


# -- FSDP1 and wrappers' names --------------------------------------------------------------------------------------
def _check_fsdp_flattened() -> None:
    t = torch.zeros(1)
    _resolve("torch.distributed.fsdp._common_utils._set_fsdp_flattened")(t)
    assert getattr(t, internals.FSDP_FLATTENED, False) is True


def _check_flat_parameter() -> None:
    assert internals.flat_parameter_class() is _resolve("torch.distributed.fsdp._flat_param.FlatParameter")


def _check_wrapper_components() -> None:
    compiled = torch.compile(nn.Linear(2, 2))  # not run: no compilation
    prefixes = {n.split(".")[0] for n, _ in compiled.named_parameters()}
    torch_names = {
        _resolve("torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE"),
        _resolve("torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE"),
        *prefixes,
    }
    assert torch_names == internals.WRAPPER_COMPONENTS, torch_names


def _check_pickled_layout() -> None:
    module, name = internals.PICKLED_LAYOUT
    assert _resolve(f"{module}.{name}")
    data = pickle.dumps(torch.strided)
    assert module.encode() in data and name.encode() in data, data


# -- torch.compile ---------------------------------------------------------------------------------------------------
def _check_dynamo_recompile_limit_lifted() -> None:
    config = _resolve("torch._dynamo.config")
    limits = {"recompile_limit": 2, "accumulated_recompile_limit": 2}
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(tuple(example_inputs[0].shape))
        return gm.forward

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f = torch.compile(double, backend=backend, fullgraph=True, dynamic=False)
    shapes = [(k,) for k in range(1, 6)]
    with config.patch(**limits):
        with internals.dynamo_recompile_limit_lifted():
            for shape in shapes:
                assert torch.equal(f(torch.ones(shape)), torch.full(shape, 2.0))
        assert {n: getattr(config, n) for n in limits} == limits, "the limits were not put back"
    assert compiled == shapes, f"compiled for {compiled} of {shapes}: the limit still applied"


# -- compiled autograd -----------------------------------------------------------------------------------------------
def _check_compiled_autograd_switches() -> None:
    config, enable = (s.split(" ")[0] for s in internals.COMPILED_AUTOGRAD_SWITCHES)
    module, _, name = config.rpartition(".")
    assert hasattr(_resolve(module), name), config
    assert callable(_resolve(enable)), enable


def _check_compiled_autograd_on() -> None:
    compiled_autograd = _resolve("torch._dynamo.compiled_autograd")
    assert not internals.compiled_autograd_on()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        assert internals.compiled_autograd_on(), "compiled autograd on, not seen"
    assert not internals.compiled_autograd_on()


def _check_compiled_autograd_configured() -> None:
    dynamo = _resolve("torch._dynamo")
    assert not internals.compiled_autograd_configured()
    with dynamo.config.patch(compiled_autograd=True):
        assert internals.compiled_autograd_configured(), "compiled autograd configured, not seen"


# -- on one gloo rank --------------------------------------------------------------------------------------------------
def _on_a_rank(ctx, entry: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = ctx.cached("mesh", lambda: init_device_mesh("cpu", (1,)))
    if entry in ("LOCAL_TENSOR", "local_tensor"):
        from torch.distributed.tensor import DTensor, Shard

        d = DTensor.from_local(torch.arange(3.0), mesh, [Shard(0)])
        assert hasattr(d, internals.LOCAL_TENSOR), "a DTensor has no local tensor"
        local = internals.local_tensor(d)
        assert local.data_ptr() == d.to_local().data_ptr() and torch.equal(local, d.to_local())
    elif entry in ("ddp_rebuilt_buckets", "DDP_REBUILT_BUCKETS"):
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        assert hasattr(ddp, internals.DDP_REBUILT_BUCKETS) and not internals.ddp_rebuilt_buckets(ddp)
    elif entry in ("fsdp_param_groups", "UNSHARDED_PARAM"):
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(nn.Sequential(nn.Linear(2, 2)), mesh=mesh)
        fp = internals.fsdp_param_groups(model)[0].fsdp_params[0]
        assert hasattr(fp, "unsharded_accumulated_grad")
        model(torch.ones(1, 2)).sum().backward()
        assert getattr(fp, internals.UNSHARDED_PARAM, None) is not None, "no unsharded parameter after a step"
    else:  # the pipelining entries
        from torch.distributed.pipelining import (
            PipelineStage,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        stage = PipelineStage(nn.Linear(2, 2), 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, 2)
        assert internals.is_schedule(schedule) and internals.n_microbatches(schedule) == 2
        assert internals.schedule_stages(schedule) == [stage]
        assert callable(getattr(stage, internals.PERFORM_REDUCE_GRAD))
        stages = [PipelineStage(nn.Linear(2, 2), i, 2, torch.device("cpu")) for i in range(2)]
        schedule = ScheduleInterleaved1F1B(stages, 2, loss_fn=lambda out, y: out.sum())
        assert internals.schedule_stages(schedule) == stages
        # the memory planner's stage: the warm-up methods it replaces, what a stage keeps between steps
        for name in (internals.STAGE_WARMUP_VOTE, internals.STAGE_WARMUP_RESULT):
            assert callable(getattr(PipelineStage, name)), name
        schedule.step(torch.ones(4, 2), target=torch.ones(4, 2))
        acts, _ = internals.stage_recv_buffers(stages[1])
        assert [t.shape for t in acts] == [(2, 2)] * 2, "no receive buffer per micro-batch on the second stage"
        assert internals.stage_recv_buffers(stages[0])[0] == []  # the first stage's inputs are the batch's
        assert [t.shape for t in internals.stage_kept_outputs(stages[1])] == [(2, 2)] * 2, "last stage's outputs"


ON_A_RANK = "on a rank"  # the check is _on_a_rank's, on one gloo rank
BOUND = "bound"  # the entry is torch's object itself


class Entry(NamedTuple):
    torch: str | None  # the torch name it reads, where one resolves without an instance: resolved first
    guards: str  # what switches off or breaks if torch moves it
    check: Callable[[], None] | str  # resolves the entry and runs what it is for; or ON_A_RANK, BOUND


_OPT, _CA = "torch.optim.optimizer", "torch._dynamo.compiled_autograd"
_REDUCER, _FOREACH = "torch._C._distributed_c10d.Reducer", "torch.utils._foreach_utils"
_NOT_STEPPED_ONCE = "would not run once per training step"

CHECKS: dict[str, Entry] = {
    # the autograd engine
    "graph_task_id": Entry(
        "torch._C._current_graph_task_id",
        "the engine would not tell one backward from the next, nor a call inside a backward", _check_graph_task_id),
    "queue_callback": Entry(
        "torch.autograd.Variable._execution_engine.queue_callback",
        "the end-of-backward settling would not run: buckets left unstepped", _check_queue_callback),
    "POST_ACCUMULATE_GRAD_HOOKS": Entry(
        None, "the warning that a later post-accumulate-grad hook sees a freed gradient would switch off",
        _check_post_accumulate_grad_hooks),
    "ENGINE_RUN_BACKWARD": Entry(
        "torch.autograd.graph._engine_run_backward",
        "the nested/reentrant-backward refusal and the retained-graph guard would switch off",
        _check_engine_run_backward),
    "ENGINE_RUN_BACKWARD_RETAIN_GRAPH": Entry(
        None, "a second loss's backward over a retained graph that stepped would not be refused by name (torch's "
              "version error, which does not say why, or a second step on the same batch)",
        _check_engine_run_backward_retain_graph),
    "BACKWARD_FUNCTION_APPLY": Entry(
        "torch.autograd.function.BackwardCFunction.apply", "the reentrant-backward refusal would switch off",
        _check_backward_function_apply),
    "FORWARD_CLS": Entry(
        None, "reentrant checkpoint segments would not be refused before a bucket outside them steps",
        _check_forward_cls),
    # torch.optim
    "global_step_pre_hooks": Entry(
        f"{_OPT}._global_optimizer_pre_hooks", f"global step pre-hooks {_NOT_STEPPED_ONCE}",
        _check_global_hooks("global_step_pre_hooks", "register_optimizer_step_pre_hook")),
    "global_step_post_hooks": Entry(
        f"{_OPT}._global_optimizer_post_hooks", f"global step post-hooks {_NOT_STEPPED_ONCE}",
        _check_global_hooks("global_step_post_hooks", "register_optimizer_step_post_hook")),
    "step_pre_hooks": Entry(
        None, f"step pre-hooks {_NOT_STEPPED_ONCE}",
        _check_optimizer_hooks("step_pre_hooks", "register_step_pre_hook")),
    "step_post_hooks": Entry(
        None, f"step post-hooks (an LR scheduler's count) {_NOT_STEPPED_ONCE}",
        _check_optimizer_hooks("step_post_hooks", "register_step_post_hook")),
    "state_dict_pre_hooks": Entry(
        None, "state_dict pre-hooks would not run",
        _check_optimizer_hooks("state_dict_pre_hooks", "register_state_dict_pre_hook")),
    "state_dict_post_hooks": Entry(
        None, "state_dict post-hooks would not run",
        _check_optimizer_hooks("state_dict_post_hooks", "register_state_dict_post_hook")),
    "load_state_dict_pre_hooks": Entry(
        None, "load_state_dict pre-hooks would not run",
        _check_optimizer_hooks("load_state_dict_pre_hooks", "register_load_state_dict_pre_hook")),
    "load_state_dict_post_hooks": Entry(
        None, "load_state_dict post-hooks would not run",
        _check_optimizer_hooks("load_state_dict_post_hooks", "register_load_state_dict_post_hook")),
    "fires_own_step_hooks": Entry(
        "torch.optim.Optimizer.profile_hook_step",
        "step hooks would fire twice per step() (torch's wrapper and the facade's)", _check_step_wrapper),
    "unwrap_profiled_step": Entry(
        "torch.optim.Optimizer.profile_hook_step", "step hooks would fire once per bucket, with an inner optimizer",
        _check_step_wrapper),
    "LR_SCHEDULER_STEP_MARK": Entry(
        None, "an LR scheduler's mark would be taken for a class's own counter, and the class refused",
        _check_lr_scheduler_mark),
    # GradScaler
    "scaler_factors": Entry(
        None, "the warning about a fused kernel under an uneven GradScaler factor would switch off",
        _check_scaler_factors),
    "scaler_scale": Entry(None, "gradients could not be unscaled in backward (grad_scaler)", _check_scaler_scale),
    "mark_unscaled": Entry(
        "torch.amp.grad_scaler.OptState.UNSCALED",
        "scaler.update() and scaler.step() would not see the inf check made in backward", _check_mark_unscaled),
    "amp_unscale_": Entry(
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "gradients could not be unscaled in backward (grad_scaler)", _check_amp_unscale),
    # kernels
    "foreach_norm": Entry("torch._foreach_norm", "the global norm would not be clip_grad_norm_'s", BOUND),
    "foreach_add_": Entry("torch._foreach_add_", "the direct fused Adam/AdamW step would fail", BOUND),
    "fused_adam_": Entry("torch._fused_adam_", "the direct fused Adam step would fail", BOUND),
    "fused_adamw_": Entry("torch._fused_adamw_", "the direct fused AdamW step would fail", BOUND),
    "group_tensors_by_device_and_dtype": Entry(
        f"{_FOREACH}._group_tensors_by_device_and_dtype",
        "norms and averaging would not group tensors as the standard loop does", BOUND),
    "foreach_supported_devices": Entry(
        f"{_FOREACH}._get_foreach_kernels_supported_devices", "averaging would not pick AveragedModel's kernel",
        BOUND),
    # tensors
    "LOCAL_TENSOR": Entry(None, "DTensor buckets could not be stepped on their local shards", ON_A_RANK),
    "local_tensor": Entry(None, "DTensor buckets could not be stepped on their local shards", ON_A_RANK),
    "tensor_version": Entry(
        None, "averaging would re-read n_averaged (a device sync) every step, or miss a change",
        _check_tensor_version),
    # the memory planner
    "FakeTensorMode": Entry(
        "torch._subclasses.fake_tensor.FakeTensorMode", "the memory planner could not trace a step", _check_fake),
    "is_fake": Entry(
        "torch._subclasses.fake_tensor.is_fake", "the planner's trace would fail on a value comparison", _check_fake),
    "unset_fake_temporarily": Entry(
        "torch._subclasses.fake_tensor.unset_fake_temporarily",
        "the planner could not plan FSDP2 over a tensor-parallel mesh (a mesh's rank tensors are real)",
        _check_unset_fake),
    "TorchDispatchMode": Entry(
        "torch.utils._python_dispatch.TorchDispatchMode", "the memory planner would see no operator",
        _check_dispatch_and_pytree),
    "tree_iter": Entry(
        "torch.utils._pytree.tree_iter", "the memory planner would miss operators' outputs",
        _check_dispatch_and_pytree),
    "tree_leaves": Entry(
        "torch.utils._pytree.tree_leaves", "the memory planner would miss a batch's tensors",
        _check_dispatch_and_pytree),
    # DDP
    "has_local_used_map": Entry(
        f"{_REDUCER}._get_local_used_map", "DDP with find_unused_parameters or static_graph would be refused",
        _check_reducer("_get_local_used_map")),
    "local_used_map": Entry(
        f"{_REDUCER}._get_local_used_map",
        "DDP could not tell which parameters some rank used (find_unused_parameters)",
        _check_reducer("_get_local_used_map")),
    "skip_grad_writeback": Entry(
        f"{_REDUCER}._set_optimizer_in_backward", "DDP would re-create every .grad at the end of backward",
        _check_reducer("_set_optimizer_in_backward")),
    "ddp_rebuilt_buckets": Entry(
        None, "two_pass under DDP would record its first iteration's gradient order twice", ON_A_RANK),
    "DDP_REBUILT_BUCKETS": Entry(
        None, "two_pass under DDP, and the planner's DDP rank, would lose the rebuilt bucket order", ON_A_RANK),
    "SKIP_GRAD_WRITEBACK": Entry(
        f"{_REDUCER}._set_optimizer_in_backward", "DDP would re-create every .grad at the end of backward",
        _check_reducer("_set_optimizer_in_backward")),
    "ddp_bucket_assignment": Entry(
        "torch.distributed._compute_bucket_assignment_by_size", "the planner's DDP rank would not have DDP's buckets",
        _check_ddp_buckets),
    "ddp_first_bucket_bytes": Entry(
        "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", "the planner's DDP rank would not have DDP's first bucket",
        _check_ddp_buckets),
    "clear_sharding_cache": Entry(
        "torch.distributed.tensor.debug._clear_sharding_prop_cache",
        "a second job in one process (the trainer's tests, the planner then a real job) would get the first one's "
        "device meshes, whose process groups are gone", _check_clear_sharding_cache),
    "fake_store": Entry(
        "torch.testing._internal.distributed.fake_pg.FakeStore", "the planner could not plan an FSDP2 rank",
        _check_fake_store),
    # FSDP2, FSDP1
    "fsdp_param_groups": Entry(
        "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
        "two_pass under FSDP2 could not tell accumulated unsharded gradients", ON_A_RANK),
    "UNSHARDED_PARAM": Entry(None, "two_pass under FSDP2 could miss accumulated unsharded gradients", ON_A_RANK),
    "fsdp_resized_tensors": Entry(
        "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.init_all_gather_outputs",
        "the planner would not see FSDP2's unsharded parameters (their storages resized in place)",
        _check_fsdp_resized_tensors),
    "fsdp_collective_ops": Entry(
        "torch.ops.c10d._allgather_base_", "the planner would not add gloo's buffers inside FSDP2's collectives",
        _check_fsdp_collective_ops),
    "FSDP_FLATTENED": Entry(
        "torch.distributed.fsdp._common_utils._set_fsdp_flattened",
        "the seed pair would step FSDP1's original parameters on local gradients, or refuse them",
        _check_fsdp_flattened),
    "flat_parameter_class": Entry(
        "torch.distributed.fsdp._flat_param.FlatParameter", "the seed pair could not tell FSDP1's flat parameter",
        _check_flat_parameter),
    # pipelining
    "n_microbatches": Entry(None, "pipeline optimizers would not know the micro-batch count", ON_A_RANK),
    "schedule_stages": Entry(None, "pipeline optimizers would not find the schedule's stages", ON_A_RANK),
    "is_schedule": Entry(None, "pipeline_optimizers would refuse every schedule", ON_A_RANK),
    "PERFORM_REDUCE_GRAD": Entry(
        "torch.distributed.pipelining.stage._PipelineStageBase.perform_reduce_grad",
        "pipeline x FSDP2 in backward would be refused", ON_A_RANK),
    "STAGE_WARMUP_VOTE": Entry(
        "torch.distributed.pipelining.stage.PipelineStage._warmup_forward_vote",
        "the planner's pipeline stages would run the warm-up vote on a fake group and fail", ON_A_RANK),
    "STAGE_WARMUP_RESULT": Entry(
        "torch.distributed.pipelining.stage.PipelineStage._warmup_backward_result",
        "the planner's pipeline stages would run the warm-up vote on a fake group and fail", ON_A_RANK),
    "stage_recv_buffers": Entry(
        None, "the planner would miss a stage's receive buffers, or fail", ON_A_RANK),
    "stage_kept_outputs": Entry(
        None, "the planner would miss the last stage's outputs kept from the step before, or fail", ON_A_RANK),
    # checkpoints
    "WRAPPER_COMPONENTS": Entry(
        None, "checkpoint names would keep a wrapper's component: a wrapped model's checkpoint would not load into "
        "an unwrapped one", _check_wrapper_components),
    "PICKLED_LAYOUT": Entry(
        "torch.serialization._get_layout", "checkpoint metadata holding a layout would be refused by the unpickler",
        _check_pickled_layout),
    # torch.compile
    "dynamo_recompile_limit_lifted": Entry(
        "torch._dynamo.config.accumulated_recompile_limit",
        "torchao's Adam step, compiled once, would run uncompiled past dynamo's limit of shapes (other bits than "
        "torchao's own loop) or fail", _check_dynamo_recompile_limit_lifted),
    # compiled autograd
    "COMPILED_AUTOGRAD_SWITCHES": Entry(
        f"{_CA}._enable", "the compiled-autograd refusal would name switches that do not exist",
        _check_compiled_autograd_switches),
    "compiled_autograd_on": Entry(
        f"{_CA}.in_compiled_autograd_region",
        "the compiled-autograd refusal would switch off: parameters silently not stepped", _check_compiled_autograd_on),
    "compiled_autograd_configured": Entry(
        "torch._dynamo.config.compiled_autograd",
        "compiled autograd configured on would not be refused at construction", _check_compiled_autograd_configured),
}


def _entries() -> list[str]:
    """The module's entries: what it defines or imports from torch, less its own imports of modules and typing."""
    module = importlib.import_module("dist_optim._torch_internals")
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and not isinstance(v, types.ModuleType) and n not in ("Any", "annotations"))


def test_every_entry_has_a_check():
    assert sorted(CHECKS) == _entries()


@pytest.mark.parametrize("entry", sorted(CHECKS))
def test_torch_still_has(entry, request):
    name, guards, check = CHECKS[entry]
    moved = f"torch moved or changed {name} ({entry} in" if name is not None else f"torch moved or changed {entry} (in"
    try:
        found = _resolve(name) if name is not None else None
    except Exception as e:
        pytest.fail(f"{moved} dist_optim/_torch_internals.py): {guards}. {type(e).__name__}: {e}", pytrace=False)
    try:
        importlib.import_module("dist_optim._torch_internals")
    except Exception as e:
        pytest.fail(f"dist_optim/_torch_internals.py does not import on this torch (another entry moved), so {entry} "
                    f"is not checked beyond its torch name: {type(e).__name__}: {e}", pytrace=False)
    try:
        if check is BOUND:
            assert getattr(internals, entry) is found, f"{entry} is not {name}"
        elif check is ON_A_RANK:
            request.getfixturevalue("ranks").run(1, _on_a_rank, entry=entry)
        else:
            check()
    except Exception as e:  # any failure is the entry's
        pytest.fail(f"{moved} dist_optim/_torch_internals.py): {guards}. {type(e).__name__}: {e}", pytrace=False)

"""Pipeline parallelism (``torch.distributed.pipelining``): each stage's :class:`InBackwardOptimizer`, built by
``dist_optim.pipeline_optimizers(schedule, ...)``, steps once per ``schedule.step()`` during the stage's last
micro-batch backward and ends bitwise where the same schedule followed by ``opt.step(); opt.zero_grad()`` ends.

Every scenario builds the same model twice on each of 2 gloo ranks, splits it into the same stages, trains one copy
with a standard optimizer per stage and the other in backward (same kernel), and compares parameters and optimizer
state with ``torch.equal``. The optimizer divides the gradients by the micro-batch count as the schedule does, so
bitwise holds for any count (4 here, 3 and 5 in their own test).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import ADAMW, SGD_MOMENTUM, STEPS
from torch import nn

import dist_optim
import dist_optim.checkpoint

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

if dist.is_available():
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )

PP_WIDTH = 8
N_LAYERS = 4  # stages of one or two layers: 2 per rank (GPipe, 1F1B) or 1 per stage, 2 stages per rank (interleaved)
MICRO_BATCHES = 4
ROWS = 2  # per micro-batch: the schedule splits a batch into equal micro-batches
MAX_NORM = 0.05  # small enough that every tensor is clipped
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"]
MULTI = {"interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev"}  # 2 stages per rank
OPTIMIZERS = {"AdamW-fused": (torch.optim.AdamW, ADAMW), "SGD-momentum-foreach": (torch.optim.SGD, SGD_MOMENTUM)}


def _layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(PP_WIDTH, PP_WIDTH), nn.Tanh()) for _ in range(N_LAYERS)]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _device(ctx) -> torch.device:
    return torch.device("cuda", ctx.rank) if ctx.backend == "nccl" else torch.device("cpu")  # NCCL: a GPU per rank


def _data(steps: int, n: int = MICRO_BATCHES, seed: int = 1, device: torch.device | str = "cpu") -> list:
    g = torch.Generator().manual_seed(seed)  # the same batches on every rank: the first stage reads x, the last y
    rows = n * ROWS
    return [(torch.randn(rows, PP_WIDTH, generator=g).to(device), torch.randn(rows, PP_WIDTH, generator=g).to(device))
            for _ in range(steps)]


def build(ctx, schedule: str, n: int = MICRO_BATCHES, scale_grads: bool = True, loss_fn=_loss):
    """This rank's stage modules (fresh copies of the same layers) and the schedule over them."""
    layers = _layers()
    if schedule in ("zbv", "dualpipev"):
        n_stages = 2 * ctx.world  # V shape: rank r holds stages r and 2 * world - 1 - r
        mine = sorted([ctx.rank, n_stages - 1 - ctx.rank])
        per = N_LAYERS // n_stages
    elif schedule in MULTI:
        n_stages = 2 * ctx.world  # stage s on rank s % world: 2 stages per rank
        mine = [s for s in range(n_stages) if s % ctx.world == ctx.rank]
        per = N_LAYERS // n_stages
    else:
        n_stages, mine, per = ctx.world, [ctx.rank], N_LAYERS // ctx.world
    device = _device(ctx)
    modules = [nn.Sequential(*copy.deepcopy(layers[s * per:(s + 1) * per])).to(device) for s in mine]
    stages = [PipelineStage(m, s, n_stages, device) for m, s in zip(modules, mine)]
    if schedule in MULTI:
        cls = {"interleaved-1f1b": ScheduleInterleaved1F1B, "looped-bfs": ScheduleLoopedBFS,
               "zero-bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
               "dualpipev": ScheduleDualPipeV}[schedule]
        sched = cls(stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=scale_grads)
    first = 0 in mine
    last = n_stages - 1 in mine
    return modules, sched, first, last


def run_step(sched, first: bool, last: bool, batch) -> None:
    x, y = batch
    args = (x,) if first else ()
    kwargs = {"target": y} if last else {}
    sched.step(*args, **kwargs)


def _clip(modules, clip: str) -> None:
    for m in modules:
        for p in m.parameters():
            if clip == "per_parameter":
                nn.utils.clip_grad_norm_([p], MAX_NORM)
            elif clip == "value":
                nn.utils.clip_grad_value_([p], MAX_NORM)


def _clip_options(clip: str) -> dict:
    if clip == "per_parameter":
        return {"max_grad_norm": MAX_NORM, "clip_mode": "per_parameter"}
    if clip == "value":
        return {"max_grad_value": MAX_NORM}
    return {}


def train_standard(ctx, schedule, opt_name, clip, steps=STEPS, n=MICRO_BATCHES, scale_grads=True):
    cls, kw = OPTIMIZERS[opt_name]
    modules, sched, first, last = build(ctx, schedule, n, scale_grads)
    opts = [cls(m.parameters(), **kw) for m in modules]
    for batch in _data(steps, n, device=_device(ctx)):
        run_step(sched, first, last, batch)
        _clip(modules, clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return modules, opts


def train_in_backward(ctx, schedule, opt_name, clip, steps=STEPS, n=MICRO_BATCHES, scale_grads=True, **engine):
    cls, kw = OPTIMIZERS[opt_name]
    modules, sched, first, last = build(ctx, schedule, n, scale_grads)
    opts = dist_optim.pipeline_optimizers(sched, cls, **kw, **_clip_options(clip), **engine)
    for batch in _data(steps, n, device=_device(ctx)):
        run_step(sched, first, last, batch)
        for m in modules:
            assert all(p.grad is None for p in m.parameters()), "a gradient outlived its stage's last backward"
        for opt in opts:
            opt.step()  # an existing loop's calls: nothing left to do
            opt.zero_grad()
    return modules, opts


def assert_same(a_modules, a_opts, b_modules, b_opts, exact: bool = True) -> None:
    compare = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7))
    for ma, mb in zip(a_modules, b_modules, strict=True):
        for (name, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
            assert compare(p, q), f"{name}: max diff {(p - q).abs().max().item():.3g}"
    for oa, ob in zip(a_opts, b_opts, strict=True):
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            for key, v in sa[k].items():
                assert compare(v, sb[k][key]), f"state {k}/{key} differs"


# -- scenarios ----------------------------------------------------------------------------------------------------
def _parity(ctx, schedule, opt_name, clip):
    want = train_standard(ctx, schedule, opt_name, clip)
    got = train_in_backward(ctx, schedule, opt_name, clip, bucket_cap_mb=1e-4)  # several buckets per stage
    assert_same(*got, *want)


@pytest.mark.parametrize("clip", ["none", "per_parameter", "value"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_equals_standard_loop(ranks, schedule, opt_name, clip):
    ranks.run(2, _parity, schedule=schedule, opt_name=opt_name, clip=clip)


def _uneven_micro_batches(ctx, schedule, n):
    # n not a power of two: x * (1/n) is not always x / n; the optimizer divides by n as the schedule does
    want = train_standard(ctx, schedule, "AdamW-fused", "none", n=n)
    got = train_in_backward(ctx, schedule, "AdamW-fused", "none", n=n, bucket_cap_mb=1e-4)
    assert_same(*got, *want)
    assert got[1][0].grad_multiplier is None


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_any_micro_batch_count_bitwise(ranks, schedule, n):
    ranks.run(2, _uneven_micro_batches, schedule=schedule, n=n)


def _no_step_then_step(ctx, schedule):
    cls, kw = OPTIMIZERS["AdamW-fused"]
    want = train_standard(ctx, schedule, "AdamW-fused", "none")
    modules, sched, first, last = build(ctx, schedule)
    opts = dist_optim.pipeline_optimizers(sched, cls, **kw)
    for batch in _data(STEPS):
        with contextlib.ExitStack() as nothing_steps:
            for opt in opts:
                nothing_steps.enter_context(opt.no_step())
            run_step(sched, first, last, batch)
        for opt in opts:  # the standard loop's step, on the gradients the schedule divided by n already
            opt.step()
            opt.zero_grad()
    assert_same(modules, opts, *want)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_no_step_then_a_standard_step_divides_once(ranks, schedule):
    ranks.run(2, _no_step_then_step, schedule=schedule)


def _reconfigured(ctx):
    # configure_clipping rebuilds the gradient policy: the schedule's division by n must survive it
    want = train_standard(ctx, "1f1b", "AdamW-fused", "value", n=3)
    cls, kw = OPTIMIZERS["AdamW-fused"]
    modules, sched, first, last = build(ctx, "1f1b", 3)
    opts = dist_optim.pipeline_optimizers(sched, cls, **kw)
    for opt in opts:
        opt.configure_clipping(max_grad_value=MAX_NORM)
    for batch in _data(STEPS, 3):
        run_step(sched, first, last, batch)
    assert_same(modules, opts, *want)


def test_division_survives_configure_clipping(ranks):
    ranks.run(2, _reconfigured)


def _sum_losses(ctx):
    # scale_grads=False: the schedule divides nothing and neither does the optimizer
    want = train_standard(ctx, "gpipe", "AdamW-fused", "none", scale_grads=False)
    got = train_in_backward(ctx, "gpipe", "AdamW-fused", "none", scale_grads=False)
    assert_same(*got, *want)
    assert got[1][0].grad_multiplier is None


def test_scale_grads_false_equals_standard_loop(ranks):
    ranks.run(2, _sum_losses)


def _own_multiplier(ctx):
    # scale_grads=False leaves the scaling to the user: a multiplier of theirs, as a standard loop scaling .grad
    modules, sched, first, last = build(ctx, "1f1b", scale_grads=False)
    opts = [torch.optim.SGD(m.parameters(), **SGD_MOMENTUM) for m in modules]
    for batch in _data(STEPS):
        run_step(sched, first, last, batch)
        for m in modules:
            for p in m.parameters():
                p.grad.mul_(0.125)
        for o in opts:
            o.step()
            o.zero_grad()
    r_modules, r_sched, first, last = build(ctx, "1f1b", scale_grads=False)
    r_opts = dist_optim.pipeline_optimizers(r_sched, torch.optim.SGD, **SGD_MOMENTUM)
    for o in r_opts:
        o.set_grad_multiplier(0.125)
    for batch in _data(STEPS):
        run_step(r_sched, first, last, batch)
    assert_same(r_modules, r_opts, modules, opts)


def test_own_multiplier_with_scale_grads_false(ranks):
    ranks.run(2, _own_multiplier)


def _steps_once_in_last_backward(ctx, schedule):
    modules, sched, first, last = build(ctx, schedule)
    opts = dist_optim.pipeline_optimizers(sched, torch.optim.SGD, **SGD_MOMENTUM)
    seen = []  # per bucket stepped: the stage's forwards still waiting for their backward (0: its last backward)
    for opt, stage in zip(opts, sched._stages if hasattr(sched, "_stages") else [sched._stage]):
        opt.register_bucket_step_hook(lambda o, params, stage=stage: seen.append(len(stage.fwd_cache)))
    for k, batch in enumerate(_data(2)):
        run_step(sched, first, last, batch)
        assert [o.micro_batches for o in opts] == [0] * len(opts)
        assert all(float(s["momentum_buffer"].abs().sum()) > 0 for o in opts for s in o.state.values())
    assert seen and set(seen) == {0}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_steps_in_each_stages_last_backward(ranks, schedule):
    ranks.run(2, _steps_once_in_last_backward, schedule=schedule)


def _zero_bubble(ctx):
    modules, sched, first, last = build(ctx, "zero-bubble")
    with pytest.raises(NotImplementedError, match="zero-bubble.*autograd.grad.*never run"):
        dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)
    # the reason: with a standard optimizer, the weights of stages past the first get their gradients without any
    # post-accumulate-grad hook running
    calls = {}
    for m, stage in zip(modules, sched._stages):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p, s=stage.stage_index: calls.__setitem__(s, calls.get(s, 0) + 1))
    run_step(sched, first, last, _data(1)[0])
    assert all(p.grad is not None for m in modules for p in m.parameters())
    return calls


def test_zero_bubble_refused_because_its_weight_gradients_run_no_hook(ranks):
    calls = ranks.run(2, _zero_bubble)
    stages_with_hooks = {s for c in calls for s in c}
    assert 1 not in stages_with_hooks and 2 not in stages_with_hooks and 3 not in stages_with_hooks, calls


def _zero_bubble_without_its_order(ctx):
    modules, sched, first, last = build(ctx, "zero-bubble")
    del sched.pipeline_order  # as a torch that renamed it: the zero-bubble refusal would find no actions to refuse
    with pytest.raises(NotImplementedError, match="keeps no pipeline_order dict on ScheduleInterleavedZeroBubble"):
        dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)


def test_a_multi_stage_schedule_without_its_order_is_refused(ranks):
    ranks.run(2, _zero_bubble_without_its_order)


def _guard_multiplier(ctx):
    modules, sched, first, last = build(ctx, "gpipe")
    (opt,) = dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)
    opt.set_grad_multiplier(0.5)
    before = [p.detach().clone() for p in modules[0].parameters()]
    with pytest.raises(RuntimeError) as info:  # the schedule wraps the backward's error in its own
        run_step(sched, first, last, _data(1)[0])
    assert "grad_multiplier is 0.5 but the schedule (scale_grads=True, 4 micro-batches) already scales" in str(
        info.value.__cause__), info.value.__cause__
    assert all(torch.equal(p, q) for p, q in zip(modules[0].parameters(), before))


def _saving_in_schedule_terms(ctx):
    modules, sched, first, last = build(ctx, "gpipe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)
    (w,) = [w for w in caught if "holds every gradient" in str(w.message)]
    said = str(w.message)
    # the schedule's micro-batches hold the gradients, in both loops: its terms, not accumulation_steps' advice
    assert said.startswith("a pipeline stage's InBackwardOptimizer holds every gradient") and (
        f"the schedule's n_microbatches={MICRO_BATCHES} (a plain stage's gradients accumulate" in said
        and "a fully_shard-ed stage" in said and "accumulation_steps" not in said
        and "instead of accumulation" not in said), said
    assert w.filename == __file__, w.filename  # the line that called pipeline_optimizers


def test_a_plain_stage_names_the_schedules_micro_batches_as_what_holds_its_gradients(ranks):
    ranks.run(2, _saving_in_schedule_terms)


def _v_schedules_refused(ctx, schedule):
    modules, sched, first, last = build(ctx, schedule)
    with pytest.raises(NotImplementedError, match=f"{type(sched).__name__} is not supported: its order has"):
        dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_zero_bubble_schedules_refused(ranks, schedule):
    ranks.run(2, _v_schedules_refused, schedule=schedule)


def test_guard_refuses_a_replaced_multiplier(ranks):
    # one rank, one stage: the step refused by a guard raises on the only stage, which no peer waits for
    ranks.run(1, _guard_multiplier)


class _Tripwire(torch.autograd.Function):
    """Identity whose backward raises on the calls in ``raise_on`` (1, 2, ... counted over the module's life): a
    micro-batch backward that fails before any of the stage's parameters gets its gradient."""

    @staticmethod
    def forward(ctx, x, calls, raise_on):
        ctx.calls, ctx.raise_on = calls, raise_on
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.calls.append(None)
        if len(ctx.calls) in ctx.raise_on:
            raise ValueError(f"backward {len(ctx.calls)} failed")
        return grad, None, None


class _Tripped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls, self.raise_on = [], set()

    def fail_backward(self, k: int) -> None:
        """Raise in the ``k``-th backward from now (1: the next one)."""
        self.raise_on.add(len(self.calls) + k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tripwire.apply(x, self.calls, self.raise_on)


def _step_after_a_failed_step(ctx):
    # GPipe, 2 stages. Step 1: stage 0's backward of micro-batch 3 (its last) fails before any gradient lands, so
    # its optimizer counted 3 backwards; stage 1 ends its step normally. Step 2: stage 0's first backward completes
    # the count while 3 of its forwards wait: refused, nothing stepped. Stage 1 fails its second backward of step 2,
    # so neither rank waits in a send or receive the other will not post. (A loss_fn that raises is no way in: the
    # last stage's schedule keeps the losses of a step that raised, and its next step backwards through their freed
    # graphs, in torch, before any hook; on stage 0 a peer's failure leaves it waiting for a gradient.)
    modules, sched, first, last = build(ctx, "gpipe")
    trip = _Tripped()
    modules[0].append(trip)  # the schedule's stage holds this module: the tripwire runs first in each backward
    (opt,) = dist_optim.pipeline_optimizers(sched, torch.optim.SGD, **SGD_MOMENTUM)
    before = [p.detach().clone() for p in modules[0].parameters()]
    batch, again = _data(2)
    if ctx.rank == 0:
        trip.fail_backward(MICRO_BATCHES)
        with pytest.raises(RuntimeError) as info:  # the schedule wraps the backward's error in its own
            run_step(sched, first, last, batch)
        assert "backward 4 failed" in str(info.value.__cause__), info.value.__cause__
        assert opt.micro_batches == MICRO_BATCHES - 1
    else:
        run_step(sched, first, last, batch)
        trip.fail_backward(2)
    with pytest.raises(RuntimeError) as info:
        run_step(sched, first, last, again)
    if ctx.rank == 0:
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError) and (
            "stage 0 would step while 3 of its forwards wait for their backward, so not in its last micro-batch "
            "backward" in str(cause) and "Nothing was stepped in this backward" in str(cause)), cause
        assert all(torch.equal(p, q) for p, q in zip(modules[0].parameters(), before)), "a refused step stepped"
        assert not any(opt.state[p] for p in modules[0].parameters())  # no momentum buffer: no step ever ran
    else:
        assert "failed" in str(info.value.__cause__), info.value.__cause__  # the one stage 1 was told to
    dist.barrier()


def test_step_after_a_failed_schedule_step_is_refused_and_steps_nothing(ranks):
    ranks.run(2, _step_after_a_failed_step)


def _interleaved_with(ctx, wrap) -> tuple[list[nn.Module], object]:
    """ScheduleInterleaved1F1B over 2 stages per rank, this rank's second stage module passed through ``wrap``: a
    refusal of that stage must not leave the first one's optimizer attached."""
    layers = _layers()
    mine = [ctx.rank, ctx.rank + ctx.world]
    modules = [nn.Sequential(copy.deepcopy(layers[s])) for s in mine]
    modules[1] = wrap(modules[1])
    stages = [PipelineStage(m, s, 2 * ctx.world, torch.device("cpu")) for m, s in zip(modules, mine)]
    return modules, ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_loss)


class _NoCubes(torch.optim.SGD):
    """SGD that refuses 3-D tensors at construction, as a class refuses tensors it cannot step (Muon, 1-D ones)."""

    def __init__(self, params, **kwargs):
        params = list(params)
        tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
        if any((t[1] if isinstance(t, tuple) else t).dim() == 3 for t in tensors):  # (name, tensor) pairs too
            raise ValueError("no 3-D tensors")
        super().__init__(params, **kwargs)


def _stages_refused(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.cached("pp-refusals-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))
    own = _stage_groups(ctx)  # a data-parallel group of this rank alone: each rank's DDP wraps its own stage

    def inner_sharded(m):
        fully_shard(m[0], mesh=mesh)  # DTensor parameters, but the stage module itself is not fully_shard-ed
        return m

    cases = [
        (lambda m: nn.parallel.DistributedDataParallel(m, process_group=own),
         rf"stage {ctx.rank + ctx.world} is wrapped in DistributedDataParallel, whose reducer the schedule drives by "
         "hand"),
        (inner_sharded, rf"stage {ctx.rank + ctx.world} holds DTensor parameters but its module is not fully_shard-ed "
                        "at its root"),
        (lambda m: fully_shard(m, mesh=mesh),
         rf"stage {ctx.rank + ctx.world} is fully_shard-ed and ScheduleInterleaved1F1B runs 2 stages on this rank"),
    ]
    for wrap, match in cases:
        modules, sched = _interleaved_with(ctx, wrap)
        with pytest.raises(NotImplementedError, match=match):
            dist_optim.pipeline_optimizers(sched, torch.optim.SGD, lr=0.1)
        attached = [n for m in modules for n, p in m.named_parameters() if p._post_accumulate_grad_hooks]
        assert not attached, f"refused, but left hooks on {attached}"

    def with_a_3d_tensor(m):
        m.register_parameter("cube", nn.Parameter(torch.zeros(2, 2, 2)))  # not used in forward
        return m

    # the second stage passes the checks, but its optimizer's class refuses its tensors: the first stage's
    # optimizer, built already, is detached again
    modules, sched = _interleaved_with(ctx, with_a_3d_tensor)
    with pytest.raises(ValueError, match="no 3-D tensors"):
        dist_optim.pipeline_optimizers(sched, _NoCubes, lr=0.1)
    attached = [n for m in modules for n, p in m.named_parameters() if p._post_accumulate_grad_hooks]
    assert not attached, f"refused, but left hooks on {attached}"
    # a stage with a dw_builder computes its weights' gradients after the backward, outside the hooks
    module = nn.Sequential(copy.deepcopy(_layers()[ctx.rank]))
    stage = PipelineStage(module, ctx.rank, ctx.world, torch.device("cpu"), dw_builder=lambda: lambda: None)
    with pytest.raises(NotImplementedError, match=rf"Schedule1F1B is not supported: stages \[{ctx.rank}\] have a "
                                                  "dw_builder"):
        dist_optim.pipeline_optimizers(Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=_loss),
                                       torch.optim.SGD, lr=0.1)
    assert not any(p._post_accumulate_grad_hooks for p in module.parameters())


def test_stages_refused_before_anything_is_attached(ranks):
    # a DDP-wrapped stage, DTensor parameters without fully_shard at the stage's root, a fully_shard-ed stage with
    # several stages per rank, a dw_builder: each refused, and no stage keeps an optimizer's hooks
    ranks.run(2, _stages_refused)


@pytest.mark.parametrize("options, error, match", [
    ({"accumulation_steps": 4}, ValueError, "the schedule's micro-batch count sets it"),
    ({"max_grad_norm": 1.0}, NotImplementedError, "clip_mode='exact'.*deadlock"),
    ({"max_grad_norm": 1.0, "clip_mode": "previous_norm"}, NotImplementedError, "its own stage only"),
    ({"max_grad_norm": 1.0, "clip_mode": "two_pass"}, NotImplementedError, "which opt.backward\\(loss\\) would have to run twice"),
])
def test_refused_options(options, error, match):
    with pytest.raises(error, match=match):
        dist_optim.pipeline_optimizers(object(), torch.optim.SGD, lr=0.1, **options)


def test_refuses_what_is_not_a_schedule():
    with pytest.raises(ValueError, match="must be a torch.distributed.pipelining schedule.*got Linear"):
        dist_optim.pipeline_optimizers(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)


# -- checkpoints: each stage saves its own part, over a group of the ranks that hold it ----------------------------
def _stage_groups(ctx):
    # one group per rank (a stage lives on one rank); created by every rank in the same order, as new_group needs
    return ctx.cached("pp-own-groups", lambda: [dist.new_group([r]) for r in range(ctx.world)])[ctx.rank]


def _shared_dir(ctx) -> str:
    import tempfile

    path = [tempfile.mkdtemp(prefix="pp_ckpt_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _train_steps(sched, first, last, modules, opts, lrs, batches):
    for batch in batches:
        run_step(sched, first, last, batch)
        for s in lrs:
            s.step()


def _resume(ctx, schedule, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    group, folder = _stage_groups(ctx), _shared_dir(ctx)
    data = _data(4)

    def fresh():
        modules, sched, first, last = build(ctx, schedule)
        opts = dist_optim.pipeline_optimizers(sched, cls, **kw)
        lrs = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8) for o in opts]
        return modules, sched, first, last, opts, lrs

    modules, sched, first, last, opts, lrs = fresh()
    stages = sched._stages if hasattr(sched, "_stages") else [sched._stage]
    _train_steps(sched, first, last, modules, opts, lrs, data[:2])
    for m, o, s, stage in zip(modules, opts, lrs, stages):
        dist_optim.checkpoint.save(f"{folder}/stage{stage.stage_index}", model=m, optimizer=o, schedulers=s,
                                   step=2, process_group=group)
    _train_steps(sched, first, last, modules, opts, lrs, data[2:])

    r_modules, r_sched, first, last, r_opts, r_lrs = fresh()  # a new job: new modules, schedule and optimizers
    for m, o, s, stage in zip(r_modules, r_opts, r_lrs, stages):
        loaded = dist_optim.checkpoint.load(f"{folder}/stage{stage.stage_index}", model=m, optimizer=o,
                                            schedulers=s, process_group=group)
        assert loaded.step == 2
    _train_steps(r_sched, first, last, r_modules, r_opts, r_lrs, data[2:])
    assert_same(r_modules, r_opts, modules, opts)
    assert [s.get_last_lr() for s in r_lrs] == [s.get_last_lr() for s in lrs]
    dist.barrier()
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_checkpoint_per_stage_resumes_bitwise(ranks, schedule):
    ranks.run(2, _resume, schedule=schedule, opt_name="AdamW-fused")


class _NamedStage(nn.Module):
    """Layers ``lo`` to ``hi - 1`` under the names the whole model gives them (``layers.2.0.weight``), as a
    pipeline split that keeps names does (the trainer's GPTStage): its checkpoint loads into the unsplit model."""

    def __init__(self, layers: list[nn.Module], lo: int, hi: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(lo, hi)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _named_state(module, opt) -> dict:
    return {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for n, p in module.named_parameters()}


def _resume_on_one_process(ctx):
    cls, kw = OPTIMIZERS["AdamW-fused"]
    group, folder, data = _stage_groups(ctx), _shared_dir(ctx), _data(4)
    module = _NamedStage(_layers(), 2 * ctx.rank, 2 * ctx.rank + 2)
    stage = PipelineStage(module, ctx.rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=_loss)
    (opt,) = dist_optim.pipeline_optimizers(sched, cls, **kw)
    for batch in data[:2]:
        run_step(sched, ctx.rank == 0, ctx.rank == 1, batch)
    dist_optim.checkpoint.save(f"{folder}/stage{ctx.rank}", model=module, optimizer=opt, step=2, process_group=group)
    saved = [None, None]
    dist.all_gather_object(saved, _named_state(module, opt))
    for batch in data[2:]:
        run_step(sched, ctx.rank == 0, ctx.rank == 1, batch)
    final = [None, None]
    dist.all_gather_object(final, {n: p.detach().clone() for n, p in module.named_parameters()})
    if ctx.rank == 0:
        # a new job on one process: the whole model, other initial values, both stages' checkpoints loaded into it
        whole = _NamedStage(_layers(seed=7), 0, N_LAYERS)
        one = dist_optim.InBackwardOptimizer(whole, cls, **kw, accumulation_steps=MICRO_BATCHES,
                                             allow_local_steps=True)  # the 2-rank group is still up: opt out of it
        for r in range(2):
            result = dist_optim.checkpoint.load(f"{folder}/stage{r}", model=whole, optimizer=one, strict=False,
                                                process_group=group)
            assert result.step == 2 and len(result.fresh) == 4  # the other stage's tensors
        got = _named_state(whole, one)
        assert sorted(got) == sorted({**saved[0], **saved[1]})
        for name, (p, state) in {**saved[0], **saved[1]}.items():
            assert torch.equal(got[name][0], p), name  # bitwise what each stage saved
            assert state.keys() == got[name][1].keys(), (name, state.keys(), got[name][1].keys())
            for k, v in state.items():
                assert torch.equal(v, got[name][1][k]), (name, k, v, got[name][1][k])
        # and it trains on: the schedule divides the summed micro-batch gradients by n, one process the losses
        for x, y in data[2:]:
            for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
                (_loss(whole(xm), ym) / MICRO_BATCHES).backward()
        want = {**final[0], **final[1]}
        for n, p in whole.named_parameters():
            torch.testing.assert_close(p.detach(), want[n], rtol=1e-5, atol=1e-6, msg=n)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()


def test_stage_checkpoints_resume_on_one_process(ranks):
    # where the split keeps the whole model's names, each stage's checkpoint loads into the unsplit model (strict=False
    # for the other stage's tensors): bitwise what was saved, then within 1e-5 of the pipeline (x / n against grad / n)
    ranks.run(2, _resume_on_one_process)


# -- pipeline x FSDP2: 2 stages, each fully_shard-ed over 2 ranks, on 4 ranks -----------------------------------------
def _pp_dp_mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    kind = _device(ctx).type  # "cuda" under NCCL (tests/gpu), else "cpu"
    return ctx.cached("pp-dp-mesh", lambda: init_device_mesh(kind, (2, 2), mesh_dim_names=("pp", "dp")))


def build_sharded(ctx, schedule: str):
    """This rank's stage (layers 2s and 2s+1, each and the stage fully_shard-ed over the dp ranks) and the schedule."""
    from torch.distributed.fsdp import fully_shard

    mesh = _pp_dp_mesh(ctx)
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    device = _device(ctx)
    module = nn.Sequential(*copy.deepcopy(_layers()[2 * pp_rank:2 * pp_rank + 2])).to(device)
    for layer in module:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    stage = PipelineStage(module, pp_rank, 2, device, group=mesh["pp"].get_group())
    make = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return [module], make(stage, n_microbatches=MICRO_BATCHES, loss_fn=_loss), pp_rank == 0, pp_rank == 1


def _pp_fsdp2_parity(ctx, schedule, opt_name, clip):
    cls, kw = OPTIMIZERS[opt_name]
    data = _data(STEPS, device=_device(ctx))
    modules, sched, first, last = build_sharded(ctx, schedule)
    opts = [cls(m.parameters(), **kw) for m in modules]
    for batch in data:
        run_step(sched, first, last, batch)
        _clip(modules, clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    r_modules, r_sched, first, last = build_sharded(ctx, schedule)
    r_opts = dist_optim.pipeline_optimizers(r_sched, cls, **kw, **_clip_options(clip), bucket_cap_mb=1e-4)
    for batch in data:
        run_step(r_sched, first, last, batch)
        assert all(p.grad is None for p in r_modules[0].parameters()), "a sharded gradient outlived the reduction"
        assert r_opts[0].last_step.params_stepped == 4  # each tensor, once per schedule.step()
    assert_same(r_modules, r_opts, modules, opts)


@pytest.mark.parametrize("clip", ["none", "per_parameter"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_x_fsdp2_equals_standard_loop(ranks, schedule, opt_name, clip):
    # FSDP2's sync is off in every micro-batch backward; the schedule reduce-scatters after the last one, outside
    # backward, and runs the sharded parameters' hooks there: each bucket steps as its reduction lands
    ranks.run(4, _pp_fsdp2_parity, schedule=schedule, opt_name=opt_name, clip=clip)


def _pp_fsdp2_resume(ctx):
    cls, kw = OPTIMIZERS["AdamW-fused"]
    mesh, folder, data = _pp_dp_mesh(ctx), _shared_dir(ctx), _data(4)
    group, stage = mesh["dp"].get_group(), mesh["pp"].get_local_rank()

    def fresh():
        modules, sched, first, last = build_sharded(ctx, "1f1b")
        opts = dist_optim.pipeline_optimizers(sched, cls, **kw)
        return modules, sched, first, last, opts, [torch.optim.lr_scheduler.CosineAnnealingLR(opts[0], T_max=8)]

    modules, sched, first, last, opts, lrs = fresh()
    _train_steps(sched, first, last, modules, opts, lrs, data[:2])
    dist_optim.checkpoint.save(f"{folder}/stage{stage}", model=modules[0], optimizer=opts[0], schedulers=lrs[0],
                               step=2, process_group=group)
    _train_steps(sched, first, last, modules, opts, lrs, data[2:])
    r_modules, r_sched, first, last, r_opts, r_lrs = fresh()  # a new job
    loaded = dist_optim.checkpoint.load(f"{folder}/stage{stage}", model=r_modules[0], optimizer=r_opts[0],
                                        schedulers=r_lrs[0], process_group=group)
    assert loaded.step == 2 and loaded.world_size == 2
    _train_steps(r_sched, first, last, r_modules, r_opts, r_lrs, data[2:])
    assert_same(r_modules, r_opts, modules, opts)
    dist.barrier()
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_pipeline_x_fsdp2_checkpoint_per_stage_resumes_bitwise(ranks):
    ranks.run(4, _pp_fsdp2_resume)


def _eval_and_rebuild(ctx):
    cls, kw = OPTIMIZERS["AdamW-fused"]
    data = _data(STEPS)
    modules, sched, first, last = build_sharded(ctx, "1f1b")
    opts = [cls(m.parameters(), **kw) for m in modules]
    for batch in data:
        run_step(sched, first, last, batch)
        opts[0].step()
        opts[0].zero_grad()

    def evaluate(schedule, batch):
        x, y = batch
        schedule.eval(*((x,) if first else ()), **({"target": y} if last else {}))

    r_modules, r_sched, first, last = build_sharded(ctx, "1f1b")
    # an evaluation runs the schedule's reduction too, with no backward: no step may begin there (a scaler that
    # has scaled nothing yet would refuse it)
    (scaled,) = dist_optim.pipeline_optimizers(r_sched, cls, **kw, grad_scaler=torch.amp.GradScaler("cpu"))
    evaluate(r_sched, data[0])
    scaled.remove()
    (opt,) = dist_optim.pipeline_optimizers(r_sched, cls, **kw)  # built again after remove(): the new one steps
    for batch in data:
        run_step(r_sched, first, last, batch)
    evaluate(r_sched, data[0])
    assert opt.last_step.params_stepped == 4  # the evaluation left the last training step's telemetry
    assert_same(r_modules, [opt], modules, opts)


def test_pipeline_x_fsdp2_evaluation_and_rebuilt_optimizers(ranks):
    ranks.run(4, _eval_and_rebuild)


def _outside_hook_refused(ctx):
    # the same stage with a plain InBackwardOptimizer: its hooks run from perform_reduce_grad, outside backward,
    # where nothing would end the step. Refused loudly instead of skipped silently.
    modules, sched, first, last = build_sharded(ctx, "1f1b")
    dist_optim.InBackwardOptimizer(modules[0], torch.optim.AdamW, **ADAMW)
    with pytest.raises(RuntimeError, match="ran outside any backward .*dist_optim.pipeline_optimizers"):
        run_step(sched, first, last, _data(1)[0])
    dist.barrier()


def test_pipeline_x_fsdp2_without_pipeline_optimizers_is_refused(ranks):
    # the shared group (a fresh one of 4 costs ~16 CPU s): what the refusal leaves mid-reduction is the scenario's own
    # modules' FSDP2 state; every rank raised at the same point and met at the barrier, so the group is in step
    ranks.run(4, _outside_hook_refused)


def _grad_scaler(ctx, schedule, kernel, init_scale):
    kw = {**ADAMW, "fused": None, kernel: True}

    def train(in_backward: bool):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
        modules, sched, first, last = build(ctx, schedule, 3, loss_fn=lambda out, y: scaler.scale(_loss(out, y)))
        if in_backward:
            opts = dist_optim.pipeline_optimizers(sched, torch.optim.AdamW, **kw, grad_scaler=scaler,
                                                  bucket_cap_mb=1e-4)
        else:
            opts = [torch.optim.AdamW(m.parameters(), **kw) for m in modules]
        scales = []
        for batch in _data(STEPS, 3):  # 3 micro-batches: dividing by 3 is inexact, so the order shows
            # a stage without the loss never calls scaler.scale(loss): its scaler is started by hand, in both loops
            scaler.scale(torch.zeros(()))
            run_step(sched, first, last, batch)
            if not in_backward:
                for opt in opts:
                    scaler.step(opt)
                    opt.zero_grad()
            scaler.update()
            scales.append(scaler.get_scale())
        return modules, opts, scales

    *want, want_scales = train(False)
    *got, got_scales = train(True)
    assert_same(*got, *want)
    assert got_scales == want_scales and got_scales[-1] > init_scale  # no overflow: the scale grew each step


# foreach with a scale that is no power of two: scaler.step unscales after the schedule divided by n, and so must
# the optimizer (the other order differs in the last bit). Fused with GradScaler's powers of two: the fused kernel
# unscales inside itself under scaler.step, which equals unscaling first only when the scale is a power of two.
@pytest.mark.parametrize(("kernel", "init_scale"), [("foreach", 1000.0), ("fused", 2.0**10)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_scaler_equals_scaler_step(ranks, schedule, kernel, init_scale):
    ranks.run(2, _grad_scaler, schedule=schedule, kernel=kernel, init_scale=init_scale)


# -- composition: EMA in backward, telemetry ------------------------------------------------------------------------
def _ema(ctx):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    cls, kw = OPTIMIZERS["AdamW-fused"]
    modules, sched, first, last = build(ctx, "1f1b")
    opts = [cls(m.parameters(), **kw) for m in modules]
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in modules]
    for batch in _data(STEPS):
        run_step(sched, first, last, batch)
        for m, o, e in zip(modules, opts, emas):
            o.step()
            o.zero_grad()
            e.update_parameters(m)
    r_modules, r_sched, first, last = build(ctx, "1f1b")
    r_opts = dist_optim.pipeline_optimizers(r_sched, cls, **kw, bucket_cap_mb=1e-4)
    r_emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in r_modules]
    for o, e, m in zip(r_opts, r_emas, r_modules):
        dist_optim.average_in_backward(o, e, m)
    for batch in _data(STEPS):
        run_step(r_sched, first, last, batch)
        n_params = sum(1 for m in r_modules for _ in m.parameters())
        assert sum(o.last_step.params_stepped for o in r_opts) == n_params  # telemetry: the stage's last backward
    for e, r in zip(emas, r_emas):
        assert all(torch.equal(a, b) for a, b in zip(e.state_dict().values(), r.state_dict().values()))
        assert int(r.n_averaged) == STEPS


def test_ema_in_backward_equals_standard_update(ranks):
    ranks.run(2, _ema)

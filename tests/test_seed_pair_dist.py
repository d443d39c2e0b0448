"""The seed pair on 2 real gloo ranks: under DDP, as torch's ``test_ddp_apply_optim_in_backward*`` use it, and on
FSDP2 with torchtitan's DCP checkpoint (``get_optimizer_state_dict(model, get_in_backward_optimizers(model))``).

torch's DDP steps parameters that carry ``_in_backward_optimizers`` from its own communication hook, whose
end-of-backward callback needs an accelerator. On a build without one the pair refuses before anything steps; on
a build with one, the results equal DDP + the standard loop. On FSDP2 a resumed run ends bitwise where an
uninterrupted FSDP2 run with the standard loop ends. Scenarios run on the shared gloo ranks (tests/dist_runner.py);
for those that attach the pair before the process group exists the ranks leave their group first.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers import (
    ADAMW_HPARAMS,
    WIDTH,
    batches,
    make_model,
    train_in_backward,
    train_standard,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_optim import apply_optimizer_in_backward, get_in_backward_optimizers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

ACCELERATOR = torch.accelerator.is_available()
# torch's DDP path for the pair needs an accelerator build; without one the pair refuses, and that is tested instead
NEEDS_ACCELERATOR = pytest.mark.skipif(
    not ACCELERATOR, reason="torch's DDP steps the pair's optimizers only on a build with an accelerator; this one "
    "has none, so the pair refuses there (test_refused_*)")
REFUSAL = r"(?s)un-reduced gradient.*without an accelerator.*InBackwardOptimizer\(ddp_model"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class _TwoLin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _equal_to_ddp_and_the_standard_loop(ctx, cls, kwargs, init_before, view):
    torch.manual_seed(ctx.rank)  # different data on each rank, or the all-reduce would change nothing
    base = _net()
    ref = DDP(copy.deepcopy(base), gradient_as_bucket_view=view)
    ref_opt = cls(ref.parameters(), **kwargs)
    model = copy.deepcopy(base)
    if init_before:
        apply_optimizer_in_backward(cls, model.parameters(), kwargs)
    model = DDP(model, gradient_as_bucket_view=view)
    if not init_before:
        apply_optimizer_in_backward(cls, model.parameters(), kwargs)
    for _ in range(4):
        x = torch.randn(10, 3)
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item()}"
            assert p.grad is None, f"{name}.grad left after backward"


def _ignored_parameter_steps_locally(ctx, init_before):
    torch.manual_seed(ctx.rank)
    model = _TwoLin()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])
    # a DDP-ignored parameter steps on its local gradient, as in DDP's standard loop: say so
    if init_before:
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.03}, allow_local_steps=True)
    net = DDP(model)
    if not init_before:
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.03}, allow_local_steps=True)
    a, b = net(torch.randn(1, 10))
    (a.transpose(0, 1) @ b).sum().backward()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach() for p in model.parameters()])
    assert not torch.equal(gathered[0][0], gathered[1][0])  # a.weight: local gradients differ
    assert torch.equal(gathered[0][1], gathered[1][1])  # b.weight: averaged


def _refused_at_the_first_backward(ctx, wrap_first):
    """With the group up the call cannot know what will reduce the gradients (a wrapper may come later): accepted,
    and the first backward whose gradient arrives un-reduced is refused there, before anything steps."""
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model) if wrap_first else None
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    ddp = ddp if ddp is not None else DDP(model)
    with pytest.raises(RuntimeError, match=REFUSAL + ".*nothing was stepped"):
        ddp(torch.randn(4, 3)).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(not p._in_backward_optimizers[0].state for p in model.parameters())


def _attached_before_the_group(ctx) -> nn.Module:
    """A script that builds its model and attaches the pair first, then joins the job (and wraps in DDP)."""
    model = _net()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    ctx.init_process_group()
    return model


def _refused_in_the_first_backward(ctx):
    attached = _attached_before_the_group(ctx)
    before = [p.detach().clone() for p in attached.parameters()]
    ddp = DDP(attached)
    with pytest.raises(RuntimeError, match=REFUSAL + ".*nothing was stepped"):
        ddp(torch.randn(4, 3)).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(attached.parameters(), before))
    assert all(len(p._in_backward_optimizers) == 1 and not p._in_backward_optimizers[0].state
               for p in attached.parameters())


# -- FSDP1 (use_orig_params=True): its runtime steps the pair's optimizers after its reduce-scatter ---------------
def _fsdp1_pair(ctx, *, cls, kwargs, order: str) -> None:
    """The pair on FSDP1's original parameters ends bitwise where FSDP1 + the standard loop ends (same optimizer
    and kernel), in every order of attaching, ``init_process_group`` and wrapping (``order``, as letters: a, g, w;
    the group is up already unless it comes after attaching)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    base = make_model(width=WIDTH)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    for what in order:
        if what == "a":
            apply_optimizer_in_backward(cls, model.parameters(), kwargs)
        elif what == "g" and order.index("g") > order.index("a"):
            ctx.init_process_group()
        elif what == "w":
            model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    ref = FSDP(ref, device_id=torch.device("cpu"), use_orig_params=True)
    ref_opt = cls(ref.parameters(), **kwargs)
    data = batches(3, width=WIDTH, seed=10 + dist.get_rank())  # each rank its own: the reduction matters
    train_in_backward(model, data)
    train_standard(ref, ref_opt, data)
    assert all(p.grad is None for p in model.parameters()), "gradients left: FSDP1 did not step the pair"
    steps = {int(o.state[p]["step"]) for p in model.parameters() for o in p._in_backward_optimizers
             if "step" in o.state.get(p, {})}
    assert steps <= {3}, f"the pair's optimizers stepped {steps} times, not once per backward"  # not by our hook too
    with FSDP.summon_full_params(model), FSDP.summon_full_params(ref):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item()}"
        assert not all(torch.equal(p, q) for p, q in zip(ref.parameters(), base.parameters()))
    if order.index("g") > order.index("a"):
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


FSDP1_OPTIMIZERS = [(torch.optim.AdamW, {**ADAMW_HPARAMS, "fused": True}),
                    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True})]


@pytest.mark.parametrize("order", ["gwa", "gaw"], ids=["group-wrap-attach", "group-attach-wrap"])
@pytest.mark.parametrize("cls,kwargs", FSDP1_OPTIMIZERS, ids=["AdamW-fused", "SGD-momentum-foreach"])
def test_fsdp1_with_the_group_up_equals_fsdp1_and_the_standard_loop(ranks, cls, kwargs, order):
    # group-attach-wrap is the order torch's own FSDP1 tests use: refused at the call before
    ranks.run(2, _fsdp1_pair, cls=cls, kwargs=kwargs, order=order)


@pytest.mark.parametrize("cls,kwargs", FSDP1_OPTIMIZERS, ids=["AdamW-fused", "SGD-momentum-foreach"])
def test_fsdp1_attach_before_the_group_equals_fsdp1_and_the_standard_loop(ranks, cls, kwargs):
    ranks.run_before_group(2, _fsdp1_pair, cls=cls, kwargs=kwargs, order="agw")


def _ddp_wrapped_model_is_freed(ctx):
    attached = _attached_before_the_group(ctx)
    ddp = DDP(attached)
    ddp(torch.randn(4, 3))  # DDP's first forward: it looks at _in_backward_optimizers and sets its hooks up
    if ACCELERATOR:
        ddp(torch.randn(4, 3)).sum().backward()
    refs = [weakref.ref(p) for p in attached.parameters()]
    del ddp, attached
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} parameters alive after del and gc.collect()"


def _fsdp2_dcp_resume_is_exact(ctx, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.cached("fsdp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))

    def sharded(seed):
        model = make_model(seed, width=WIDTH)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    kwargs = ADAMW_HPARAMS  # no kernel named: the for-loop on both sides
    data = batches(6, width=WIDTH, seed=10 + ctx.rank)
    model, ref = sharded(0), sharded(0)
    apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kwargs)
    train_in_backward(model, data[:3])
    train_standard(ref, ref_opt, data[:3])
    saved = get_optimizer_state_dict(model, get_in_backward_optimizers(model))
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=ckpt_dir)

    resumed = sharded(5)
    apply_optimizer_in_backward(torch.optim.AdamW, resumed.parameters(), kwargs)
    opts = get_in_backward_optimizers(resumed)
    target = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opts)}
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_model_state_dict(resumed, target["model"])
    set_optimizer_state_dict(resumed, opts, target["optim"])
    train_in_backward(resumed, data[3:])
    train_standard(ref, ref_opt, data[3:])
    for (name, p), q in zip(resumed.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"{name} differs after the resume"
    ours, theirs = get_optimizer_state_dict(resumed, opts), get_optimizer_state_dict(ref, ref_opt)
    assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) == 10
    for fqn, state in theirs["state"].items():
        for key, v in state.items():
            w = ours["state"][fqn][key]
            assert torch.equal(w.full_tensor() if hasattr(w, "full_tensor") else w,
                               v.full_tensor() if hasattr(v, "full_tensor") else v), f"{fqn}[{key!r}]"


@NEEDS_ACCELERATOR
@pytest.mark.parametrize("init_before", [True, False], ids=["attach-then-wrap", "wrap-then-attach"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize(
    "cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 1e-2})],
    ids=["SGD", "Adam"],
)
def test_ddp_equals_ddp_and_the_standard_loop(ranks, cls, kwargs, view, init_before):
    ranks.run(2, _equal_to_ddp_and_the_standard_loop, cls=cls, kwargs=kwargs, init_before=init_before, view=view)


@NEEDS_ACCELERATOR
@pytest.mark.parametrize("init_before", [True, False], ids=["attach-then-wrap", "wrap-then-attach"])
def test_ddp_ignored_parameter_steps_locally(ranks, init_before):
    ranks.run(2, _ignored_parameter_steps_locally, init_before=init_before)


@pytest.mark.skipif(ACCELERATOR, reason="with an accelerator torch's DDP steps the pair (test_ddp_equals_*)")
@pytest.mark.parametrize("wrap_first", [False, True], ids=["attach-then-wrap", "wrap-then-attach"])
def test_refused_at_the_first_backward_without_an_accelerator(ranks, wrap_first):
    ranks.run(2, _refused_at_the_first_backward, wrap_first=wrap_first)


@pytest.mark.skipif(ACCELERATOR, reason="with an accelerator torch's DDP steps the pair (test_ddp_equals_*)")
def test_refused_in_the_first_backward_without_an_accelerator(ranks):
    ranks.run_before_group(2, _refused_in_the_first_backward)


def test_ddp_wrapped_model_is_freed(ranks):
    ranks.run_before_group(2, _ddp_wrapped_model_is_freed)


def test_fsdp2_dcp_resume_is_exact(ranks, tmp_path):
    ranks.run(2, _fsdp2_dcp_resume_is_exact, ckpt_dir=str(tmp_path / "ckpt"))

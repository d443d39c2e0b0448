"""The seed pair on 2 real gloo ranks: under DDP, as torch's ``test_ddp_apply_optim_in_backward*`` use it, and on
FSDP2 with torchtitan's DCP checkpoint (``get_optimizer_state_dict(model, get_in_backward_optimizers(model))``).

torch's DDP steps parameters that carry ``_in_backward_optimizers`` from its own communication hook, whose
end-of-backward callback needs an accelerator. On a build without one the pair refuses before anything steps; on
a build with one, the results equal DDP + the standard loop. On FSDP2 a resumed run ends bitwise where an
uninterrupted FSDP2 run with the standard loop ends. All scenarios share one process group.
"""

from __future__ import annotations

import copy
import gc
import os
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_optim import apply_optimizer_in_backward, get_in_backward_optimizers
from helpers import batches, make_model, train_in_backward, train_standard

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

ACCELERATOR = torch.accelerator.is_available()


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


def _equal_to_ddp_and_the_standard_loop(rank, cls, kwargs, init_before, view):
    torch.manual_seed(rank)  # different data on each rank, or the all-reduce would change nothing
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


def _ignored_parameter_steps_locally(rank, init_before):
    torch.manual_seed(rank)
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


def _refused_at_the_call(rank, wrap_first):
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model) if wrap_first else None
    refusal = r"(?s)un-reduced gradient.*without an accelerator.*InBackwardOptimizer\(ddp_model"
    with pytest.raises(RuntimeError, match=refusal):
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    assert not any(hasattr(p, "_in_backward_optimizers") for p in model.parameters())
    ddp = ddp if ddp is not None else DDP(model)
    ddp(torch.randn(4, 3)).sum().backward()  # a standard loop still works on the model
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def _refused_in_the_first_backward(rank, attached):
    """The pair was attached while the process had no group yet; the model is then DDP-wrapped."""
    before = [p.detach().clone() for p in attached.parameters()]
    ddp = DDP(attached)
    refusal = r"(?s)un-reduced gradient.*without an accelerator.*InBackwardOptimizer\(ddp_model.*nothing was"
    with pytest.raises(RuntimeError, match=refusal):
        ddp(torch.randn(4, 3)).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(attached.parameters(), before))
    assert all(len(p._in_backward_optimizers) == 1 and not p._in_backward_optimizers[0].state
               for p in attached.parameters())


def _ddp_wrapped_model_is_freed(rank, attached):
    ddp = DDP(attached)
    ddp(torch.randn(4, 3))  # DDP's first forward: it looks at _in_backward_optimizers and sets its hooks up
    if ACCELERATOR:
        ddp(torch.randn(4, 3)).sum().backward()
    refs = [weakref.ref(p) for p in attached.parameters()]
    return refs


def _fsdp2_dcp_resume_is_exact(rank, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(seed):
        model = make_model(seed, width=16)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    data = batches(6, width=16, seed=10 + rank)
    model, ref = sharded(0), sharded(0)
    apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kwargs)  # the for-loop on both sides: bitwise
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


def _scenarios(rank, attached, result_dir):
    yield "FSDP2/DCP resume", lambda: _fsdp2_dcp_resume_is_exact(rank, os.path.join(result_dir, "ckpt"))
    if ACCELERATOR:
        for name, cls, kwargs in [("SGD", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                  ("Adam", torch.optim.Adam, {"lr": 1e-2})]:
            for view in (False, True):
                for init_before in (True, False):
                    yield (f"{name}/bucket_view={view}/init_before={init_before}",
                           lambda c=cls, k=kwargs, v=view, i=init_before: _equal_to_ddp_and_the_standard_loop(
                               rank, c, k, i, v))
        for init_before in (True, False):
            yield f"ignored/init_before={init_before}", lambda i=init_before: _ignored_parameter_steps_locally(rank, i)
    else:
        for wrap_first in (False, True):
            yield f"refused at the call/wrap_first={wrap_first}", lambda w=wrap_first: _refused_at_the_call(rank, w)
        yield "refused in the first backward", lambda: _refused_in_the_first_backward(rank, attached.pop())


def _worker(rank: int, world: int, store_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    # attached before the process group exists, as a script that builds its model first would
    attached = []
    for _ in range(2):
        model = _net()
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        attached.append(model)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    failures = []
    try:
        for name, run in _scenarios(rank, attached, result_dir):
            try:
                run()
            except Exception:  # collect, so that one failure does not hide the others
                failures.append(f"{name}: {traceback.format_exc(limit=3)}")
            dist.barrier()
        try:
            refs = _ddp_wrapped_model_is_freed(rank, attached.pop())
            gc.collect()
            alive = [r for r in refs if r() is not None]
            assert not alive, f"{len(alive)} of {len(refs)} parameters alive after del and gc.collect()"
        except Exception:
            failures.append(f"freed after DDP-wrapping: {traceback.format_exc(limit=3)}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))


def test_seed_pair_under_ddp(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    failures = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    assert not any(failures), "failed scenarios (name: traceback):\n" + "\n".join(failures)

"""How long an optimizer lives: as long as the parameters it steps, which hold it (``_in_backward_engine`` in their
``__dict__``), so a dropped reference keeps training; and never longer: dropping model and optimizer frees both,
on one process, with an averaged model attached, under DDP and under FSDP2 (2 gloo ranks)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers import (
    ADAMW,
    WIDTH,
    assert_same_params,
    assert_same_state,
    batches,
    loss_of,
    make_model,
    twins,
)
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from dist_optim import InBackwardOptimizer
from dist_optim.averaging import average_in_backward


def _train(model, data):
    for batch in data:
        loss_of(model, batch).backward()


def _gone(refs):
    gc.collect()
    return [r for r in refs if r() is not None]


def test_a_dropped_reference_keeps_training_bitwise_as_the_kept_one():
    dropped, kept = twins()
    data = batches(4)
    InBackwardOptimizer(dropped.parameters(), torch.optim.AdamW, **ADAMW)  # no reference kept
    opt = InBackwardOptimizer(kept.parameters(), torch.optim.AdamW, **ADAMW)
    gc.collect()
    _train(dropped, data)
    _train(kept, data)
    assert_same_params(dropped, kept)
    assert all(p.grad is None for p in dropped.parameters())  # stepped and freed in backward, every time
    # the parameters still lead to it: its state is the kept one's
    found = dropped.head.weight.__dict__["_in_backward_engine"].engine.owner.opt
    assert isinstance(found, InBackwardOptimizer) and found is not opt
    assert_same_state(found.state_dict(), opt.state_dict())


@pytest.mark.parametrize("after", ["training", "remove"])
def test_dropping_model_and_optimizer_frees_both(after):
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    _train(model, batches(2))
    if after == "remove":
        opt.remove()
        assert all("_in_backward_engine" not in p.__dict__ for p in model.parameters())
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(opt), weakref.ref(opt._engine)]
    del model, opt
    assert not _gone(refs)


def test_dropping_the_model_alone_frees_both_once_the_optimizer_is_dropped_too():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, foreach=True)
    _train(model, batches(1))
    refs = [weakref.ref(p) for p in model.parameters()]
    del model
    assert len(_gone(refs)) == len(refs)  # the optimizer holds its parameters, as any torch optimizer does
    del opt
    assert not _gone(refs)


def test_with_an_averaged_model_attached_everything_is_freed():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    average_in_backward(opt, ema, model)
    del opt  # the averaging goes on: the optimizer lives on through the parameters
    _train(model, batches(2))
    assert int(ema.n_averaged) == 2
    refs = [weakref.ref(p) for p in (*model.parameters(), *ema.parameters())]
    del model, ema
    assert not _gone(refs)


def test_removed_optimizer_lets_go_and_stops_stepping():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, foreach=True)
    ref = weakref.ref(opt)
    opt.remove()
    del opt
    assert not _gone([ref])
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batches(1)[0]).backward()
    assert all(torch.equal(p, q) and p.grad is not None for p, q in zip(model.parameters(), before))


def test_two_optimizers_over_disjoint_parameters_each_live_and_step():
    model, ref = twins()
    data = batches(3)
    body = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    InBackwardOptimizer(body, torch.optim.AdamW, **ADAMW)
    InBackwardOptimizer(model.head.parameters(), torch.optim.SGD, lr=0.1, foreach=True)
    gc.collect()
    _train(model, data)
    ref_body = [p for name, p in ref.named_parameters() if not name.startswith("head.")]
    std = [torch.optim.AdamW(ref_body, **ADAMW), torch.optim.SGD(ref.head.parameters(), lr=0.1, foreach=True)]
    for batch in data:
        loss_of(ref, batch).backward()
        for o in std:
            o.step()
            o.zero_grad()
    assert_same_params(model, ref)
    engines = {id(p.__dict__["_in_backward_engine"].engine) for p in model.parameters()}
    assert len(engines) == 2


def test_a_second_optimizer_over_the_same_parameters_is_refused_even_after_the_first_was_dropped():
    model = make_model()
    InBackwardOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    gc.collect()
    with pytest.raises(ValueError, match=r"parameter param_groups\[0\]\[0\] is already stepped in backward by "
                                         "InBackwardOptimizer"):
        InBackwardOptimizer(model.head.parameters(), torch.optim.AdamW)
    model.head.weight.__dict__["_in_backward_engine"].engine.owner.opt.remove()
    other = InBackwardOptimizer(model.head.parameters(), torch.optim.AdamW)  # fine once the first let go
    assert other.param_groups[0]["params"][0] is model.head.weight


def test_copies_and_pickles_of_a_parameter_carry_no_optimizer():
    model = make_model()
    opt = InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    _train(model, batches(1))
    buf = io.BytesIO()
    torch.save(model.head.weight, buf)  # a Parameter saved whole: its __dict__ travels
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert torch.equal(loaded, model.head.weight) and loaded.__dict__ == {"_in_backward_engine": {}}
    whole = pickle.loads(pickle.dumps(model))  # the module pickled whole, as torch.save(model) does
    assert all(p.__dict__ == {"_in_backward_engine": {}} for p in whole.parameters())
    copied = copy.deepcopy(model)  # nn.Parameter's deepcopy copies no attributes (nor hooks)
    assert all(p.__dict__ == {} for p in copied.parameters())
    plain = torch.randn(3, requires_grad=True)  # a plain tensor's deepcopy copies its __dict__: not the link
    other = InBackwardOptimizer([plain], torch.optim.SGD, lr=0.1)
    assert copy.deepcopy(plain).__dict__ == {"_in_backward_engine": {}}
    assert opt is not None and other is not None


# -- DDP and FSDP2, 2 gloo ranks ---------------------------------------------------------------------------------
def _wrap(ctx, kind, module):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.cached("fsdp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))
    for layer in module.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def _dropped_and_kept(ctx, kind):
    """Trains a wrapped model whose optimizer was dropped next to one whose optimizer was kept; returns weak
    references to both models, their parameters and the kept optimizer (nothing else holds them)."""
    base = make_model(width=WIDTH)
    dropped, kept = (_wrap(ctx, kind, copy.deepcopy(base)) for _ in range(2))
    InBackwardOptimizer(dropped, torch.optim.AdamW, bucket_cap_mb=1e-3, **ADAMW)
    opt = InBackwardOptimizer(kept, torch.optim.AdamW, bucket_cap_mb=1e-3, **ADAMW)
    gc.collect()
    for batch in batches(3, width=WIDTH, seed=10 + ctx.rank):
        loss_of(dropped, batch).backward()
        loss_of(kept, batch).backward()
    local = [(getattr(p, "to_local", lambda p=p: p)(), getattr(q, "to_local", lambda q=q: q)())
             for p, q in zip(dropped.parameters(), kept.parameters())]
    assert all(torch.equal(a, b) for a, b in local), "the dropped optimizer's model differs from the kept one's"
    assert all(p.grad is None for p in dropped.parameters())
    return [weakref.ref(x) for x in (dropped, kept, opt, *dropped.parameters(), *kept.parameters())]


def _dropped_reference_keeps_training_and_frees(ctx, kind):
    refs = _dropped_and_kept(ctx, kind)
    alive = _gone(refs)
    assert not alive, f"{len(alive)} of {len(refs)} objects alive after gc.collect(): {alive[:3]}"


@pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_distributed_dropped_reference_keeps_training_and_everything_is_freed(ranks, kind):
    ranks.run(2, _dropped_reference_keeps_training_and_frees, kind=kind)

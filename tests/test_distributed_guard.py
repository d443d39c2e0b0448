"""In a multi-rank job, plain hooks would step on local, un-reduced gradients: refused unless asked for.

Real gloo process groups (tests/dist_runner.py); the models are built before the process group exists: the ranks
leave theirs first (``ranks.run_before_group``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from helpers import (
    assert_same_params,
    batches,
    make_model,
    train_in_backward,
    train_standard,
)
from test_reordered_draws import NoisySGD

import dist_optim
from dist_optim import _torch_internals as internals

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")


def _worker(ctx) -> None:
    rank, world = ctx.rank, ctx.world
    # Built in a single process, then the job becomes multi-rank (and the model would be wrapped in DDP, which
    # reduces after these hooks): the next backward must refuse instead of stepping on local gradients.
    early, early_seed = make_model(), make_model()
    early_opt = dist_optim.InBackwardOptimizer(early.parameters(), torch.optim.SGD, lr=0.1)
    dist_optim.apply_optimizer_in_backward(torch.optim.SGD, early_seed.parameters(), {"lr": 0.1})
    ctx.init_process_group()
    try:
        for m in (early, early_seed):
            before = m.head.weight.detach().clone()
            with pytest.raises(RuntimeError, match="un-reduced gradient"):
                train_in_backward(m, batches(1))
            assert torch.equal(m.head.weight, before)
        assert early_opt is not None
        model = make_model()
        with pytest.raises(RuntimeError, match="2 ranks is initialised.*fully_shard.*allow_local_steps=True"):
            dist_optim.InBackwardOptimizer(model.parameters(), torch.optim.AdamW)
        # the seed pair cannot know at the call whether a wrapper (FSDP1) will take the step over: its first
        # backward is refused, before anything steps
        seeded = make_model()
        dist_optim.apply_optimizer_in_backward(torch.optim.SGD, seeded.parameters(), {"lr": 0.1})
        before = seeded.head.weight.detach().clone()
        with pytest.raises(RuntimeError, match="un-reduced gradient.*nothing was stepped"):
            train_in_backward(seeded, batches(1))
        assert torch.equal(seeded.head.weight, before)
        # Local SGD, asked for: each rank steps on its own data, exactly like a local standard loop.
        ref = copy.deepcopy(model)
        # fused on both sides (the engine's own choice, named here): bitwise needs the same kernel
        opt = dist_optim.InBackwardOptimizer(model.parameters(), torch.optim.AdamW, allow_local_steps=True, fused=True)
        data = batches(3, seed=10 + rank)
        train_in_backward(model, data)
        train_standard(ref, torch.optim.AdamW(ref.parameters(), fused=True), data)
        assert_same_params(model, ref)
        gathered = [torch.empty_like(model.head.weight) for _ in range(world)]
        dist.all_gather(gathered, model.head.weight.detach())
        assert not torch.equal(gathered[0], gathered[1])  # the replicas did drift: local steps, as requested
        assert opt is not None
    finally:
        dist.destroy_process_group()


def test_multi_rank_job_without_a_wrapper_is_refused(ranks):
    ranks.run_before_group(2, _worker)


def _options_differ(ctx) -> None:
    rank = ctx.rank
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    # Options that differ across ranks are refused on every rank, naming the option and the ranks.
    with pytest.raises(ValueError, match=r"different options on different ranks.*param_groups\[0\]\.lr: "
                                         r"0\.1 on ranks \[0\]; 0\.2 on ranks \[1\]"):
        dist_optim.InBackwardOptimizer(ddp, torch.optim.SGD, lr=0.1 * (rank + 1))
    # Clipping on one rank only would wait forever in its norm's collective: refused instead.
    with pytest.raises(ValueError, match=r"max_grad_norm: 1\.0 on ranks \[0\]; None on ranks \[1\]"):
        dist_optim.InBackwardOptimizer(ddp, torch.optim.SGD, lr=0.1, max_grad_norm=1.0 if rank == 0 else None)
    # A rank whose construction raises (an option torch refuses, a class refused on that rank only) raises its
    # own error; the other ranks raise too, naming it, instead of waiting for it in the options check.
    for kwargs, error, message in (
        ({"lr": 0.1 if rank == 0 else -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"random_draws": "reordered" if rank == 0 else "exact"}, NotImplementedError, "random_draws='reordered'"),
        ({"lr": 0.1, "bucket_cap_mb": 25 if rank == 0 else 0}, ValueError, "bucket_cap_mb must be > 0"),  # engine's
    ):
        cls = NoisySGD if "random_draws" in kwargs else torch.optim.SGD
        if rank == 1:
            with pytest.raises(error, match=message):
                dist_optim.InBackwardOptimizer(ddp, cls, per_parameter=True, **kwargs)
        else:
            with pytest.raises(RuntimeError, match=r"raised on other ranks while it was built.*ranks \[1\]: "
                                                   f"{error.__name__}: .*{re.escape(message)}"):
                dist_optim.InBackwardOptimizer(ddp, cls, per_parameter=True, **kwargs)
        assert not any(getattr(p, internals.POST_ACCUMULATE_GRAD_HOOKS) for p in ddp.parameters())  # none stayed
    # the same over FSDP2's DTensor parameters (the mesh's groups)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(make_model(), mesh=init_device_mesh("cpu", (2,)))
    expected = (ValueError, "Invalid learning rate") if rank == 1 else (RuntimeError, r"ranks \[1\]: ValueError")
    with pytest.raises(expected[0], match=expected[1]):
        dist_optim.InBackwardOptimizer(sharded, torch.optim.SGD, lr=0.1 if rank == 0 else -1.0)
    # DDP rebuilds its buckets after iteration 0: only the current ones are listed, each parameter once.
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=300 / 2**20)
    opt = dist_optim.InBackwardOptimizer(ddp, torch.optim.SGD, lr=0.1)
    train_in_backward(ddp, batches(3, seed=10 + rank))
    listed = [id(p) for bucket in opt.buckets for p in bucket]
    assert sorted(listed) == sorted(id(p) for p in ddp.parameters()), (len(listed), len(opt.buckets))
    assert len(opt.buckets) > 1


def test_options_are_compared_across_ranks_and_ddp_buckets_are_the_current_ones(ranks):
    ranks.run(2, _options_differ)


# -- a second process group in one process ----------------------------------------------------------------------
def _two_jobs_in_one_process(ctx, clear: bool) -> str:
    """Two FSDP2 (HSDP 1 x 2) jobs one after the other in each rank's process; the second makes two groups first, so
    its mesh's groups take other names. ``clear``: the first job clears DTensor's sharding cache before it destroys
    its process group, as launch/runtime.stop does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def job(extra_groups: int) -> dist_optim.InBackwardOptimizer:
        ctx.init_process_group()
        for _ in range(extra_groups):
            dist.new_group([0, 1])
        model = make_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
        return dist_optim.InBackwardOptimizer(model, torch.optim.SGD, lr=0.1)

    job(0)
    if clear:
        internals.clear_sharding_cache()
    dist.destroy_process_group()
    try:
        job(2)
        outcome = "built"
    except RuntimeError as e:
        outcome = str(e)
    ctx.leave_group()
    return outcome


def test_a_mesh_of_an_earlier_process_group_is_refused_and_clearing_the_cache_keeps_it_out(ranks):
    # torch hands the first job's mesh to the second job's parameters (DTensor's sharding cache: equal meshes); its
    # group names are the second job's other groups now: the optimizer's collectives would run over those
    stale = ranks.run_before_group(2, _two_jobs_in_one_process, clear=False)
    for rank, message in enumerate(stale):
        assert re.search(rf"names process group '\d+', which holds ranks \[0, 1\], not the mesh's \[{rank}\] along "
                         r"dimension 0: it is a mesh of an earlier process group", message), message
        assert "torch.distributed.tensor.debug._clear_sharding_prop_cache() before destroy_process_group()" in message
    assert ranks.run_before_group(2, _two_jobs_in_one_process, clear=True) == ["built", "built"]

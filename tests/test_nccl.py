"""The CUDA/NCCL path: DDP and FSDP2 with in-backward steps against the standard loop, on 2 GPUs.

Runs only where CUDA with 2 or more devices and NCCL are present (never on the CPU-only CI); the same scenarios run
on gloo/CPU in test_ddp.py and test_fsdp2.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dist_optim
from helpers import batches, loss_of, make_model

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_available()
         and dist.is_nccl_available()),
    reason="needs CUDA with 2+ GPUs and NCCL; the gloo/CPU tests cover the same behaviour",
)


def _run(rank: int, world: int, store_path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        data = [(x.cuda(), y.cuda()) for x, y in batches(3, width=16, seed=10 + rank)]
        for wrapper in ("ddp", "fsdp2"):
            base = make_model(width=16).cuda()
            a, b = copy.deepcopy(base), copy.deepcopy(base)
            if wrapper == "ddp":
                a = torch.nn.parallel.DistributedDataParallel(a, bucket_cap_mb=0.002)
                b = torch.nn.parallel.DistributedDataParallel(b, bucket_cap_mb=0.002)
            else:
                mesh = init_device_mesh("cuda", (world,))
                for m in (a, b):
                    for layer in m.layers:
                        fully_shard(layer, mesh=mesh)
                    fully_shard(m, mesh=mesh)
            opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, lr=1e-2, fused=True)
            ref = torch.optim.AdamW(b.named_parameters() if wrapper == "ddp" else b.parameters(), lr=1e-2, fused=True)
            for batch in data:
                loss_of(a, batch).backward()
                loss_of(b, batch).backward()
                ref.step()
                ref.zero_grad()
            torch.cuda.synchronize()
            for p, q in zip(a.parameters(), b.parameters()):
                full = (lambda t: t.full_tensor()) if wrapper == "fsdp2" else (lambda t: t)
                assert torch.equal(full(p), full(q)), wrapper
            assert opt.last_step.params_stepped > 0
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_on_nccl_equal_the_standard_loop(tmp_path):
    mp.spawn(_run, args=(2, str(tmp_path / "store")), nprocs=2, join=True)

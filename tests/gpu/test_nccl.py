"""DDP, FSDP2 and HSDP on NCCL: in-backward fused AdamW against the standard loop, bitwise (both sides run the same
reduction and the same fused kernel), over many steps, with a stress mode and FSDP2's CPUOffloadPolicy.

Where the CUDA streams matter: DDP's comm hook returns a CUDA future completed by the NCCL stream; FSDP2 allocates
the reduce-scatter output on its reduce-scatter stream, views each sharded gradient into it and runs the
post-accumulate-grad hooks under its post-reduce stream, which under HSDP is the all-reduce stream (another stream
than the one that owns the gradient's memory: the case where a gradient freed without a stream record is reused
first); with CPUOffloadPolicy the hooks read a CPU gradient that FSDP2 copies synchronously because hooks exist. A
gradient freed while a queued kernel still reads it, or read before its reduction is done, shows as a difference
from the standard loop; the stress mode (many equal small layers, the GPU held behind the CPU by a spin kernel)
makes the allocator's reuse of such a block likely.

How the ranks adapt to the machine: NCCL runs one rank per GPU, so the 2-rank cases need 2 GPUs. With one GPU the
same scenarios run on 1 NCCL rank: DDP still buckets and reduces through its comm hook on the NCCL stream (a 1-rank
all-reduce is still an asynchronous NCCL call with a CUDA future), and FSDP2 still copies into a reduce-scatter
buffer, allocates its output on the reduce-scatter stream and calls the hooks under the post-reduce stream, though
it skips the collective; HSDP on a 1 x 1 mesh still all-reduces on its all-reduce stream. Two gloo ranks sharing one
GPU are not used: gloo takes CUDA tensors for a few collectives only (not FSDP2's reduce-scatter) and stages them
through host copies, not the NCCL streams whose ordering is under test. Skipped without CUDA and NCCL (CPU CI):
test_ddp.py and test_fsdp2.py run the same comparisons on gloo.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from cuda_helpers import CUDA_STEPS, STRESS_STEPS, lag_backward
from helpers import ADAMW, WIDTH, batches, loss_of, make_model

import dist_optim

NCCL = torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
GPUS = torch.cuda.device_count() if NCCL else 0


def world(n: int):
    """A world-size parameter that skips, with the reason, where this machine cannot run ``n`` NCCL ranks."""
    if not NCCL:
        why = "needs CUDA and NCCL (none in this torch build or machine); test_ddp.py and test_fsdp2.py cover the " \
              "same on gloo; run tests/gpu/run.sh on a GPU machine"
    else:
        why = f"needs {n} GPUs, this machine has {GPUS}: NCCL runs one rank per GPU (the 1-rank case ran instead)"
    return pytest.param(n, id=f"{n}rank", marks=pytest.mark.skipif(GPUS < n, reason=why))


WORLDS = [world(1), world(2)]


@pytest.fixture(scope="module")
def nccl_ranks():
    from dist_runner import Pool

    pool = Pool(backend="nccl")
    yield pool
    pool.close()


def _parity(ctx, wrapper: str, stress: bool, offload: bool = False) -> int:
    """Train the in-backward model and the standard loop side by side, batch by batch; compare every rank's
    parameters (FSDP2: its local shards) bitwise. Returns the tensors the last in-backward step stepped."""
    device = torch.device("cuda", ctx.rank) if ctx.backend == "nccl" else torch.device("cpu")
    width, depth, steps = (32, 48, STRESS_STEPS) if stress else (WIDTH, 3, CUDA_STEPS)
    base = make_model(width=width, depth=depth).to(device)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    if wrapper == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        a, b = (torch.nn.parallel.DistributedDataParallel(m, device_ids=ids, bucket_cap_mb=0.002) for m in (a, b))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if wrapper == "hsdp":  # replicas of one shard: the hooks run under FSDP2's all-reduce stream
            mesh = init_device_mesh(device.type, (ctx.world, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (ctx.world,))
        options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy()} if offload else {"mesh": mesh}
        for m in (a, b):
            for layer in m.layers:
                fully_shard(layer, **options)
            fully_shard(m, **options)
    if stress and device.type == "cuda":
        lag_backward(a)
        lag_backward(b)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW, bucket_cap_mb=0.001 if stress else 0.01)
    ref = torch.optim.AdamW(b.parameters(), **ADAMW)
    for batch in batches(steps, width=width, seed=10 + ctx.rank):
        batch = tuple(t.to(device) for t in batch)
        loss_of(a, batch).backward()
        loss_of(b, batch).backward()
        ref.step()
        ref.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize()
    local = (lambda t: t) if wrapper == "ddp" else (lambda t: t.to_local())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(local(p), local(q)), \
            f"{wrapper} rank {ctx.rank}: {name} differs, max |diff| {(local(p) - local(q)).abs().max().item()}"
        assert p.grad is None, f"{wrapper} rank {ctx.rank}: {name}.grad kept after the in-backward step"
    assert opt.last_step.params_stepped > 0
    return opt.last_step.params_stepped


@pytest.mark.parametrize("stress", [False, True], ids=["plain", "stress"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "hsdp"])
@pytest.mark.parametrize("n", WORLDS)
def test_in_backward_equals_standard_loop_on_nccl(nccl_ranks, n, wrapper, stress):
    stepped = nccl_ranks.run(n, _parity, wrapper=wrapper, stress=stress)
    if wrapper != "fsdp2":  # every rank steps every parameter (HSDP: its one shard) with the averaged gradient
        assert len(set(stepped)) == 1, stepped


@pytest.mark.parametrize("n", WORLDS)
def test_fsdp2_cpu_offload_on_nccl(nccl_ranks, n):
    """CPUOffloadPolicy: sharded parameters, gradients and AdamW state on the CPU; FSDP2 copies each gradient to
    the host before the hook steps it (blocking, because a hook exists)."""
    nccl_ranks.run(n, _parity, wrapper="fsdp2", stress=False, offload=True)

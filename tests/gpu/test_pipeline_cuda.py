"""The pipeline path on CUDA with NCCL: a stage's in-backward optimizer against the same schedule with the standard
loop, bitwise (fused AdamW on both sides), as tests/test_pipeline.py checks on gloo.

On CUDA the stage's backward and its in-backward step run on the default stream, and the schedule's sends and
receives on NCCL's; a gradient freed while the step's kernels still read it would show as a difference. NCCL runs
one rank per GPU: with one GPU the single-stage case runs (stage 0 is first and last), with two the 2-stage one,
with four pipeline x FSDP2 (2 stages, each fully_shard-ed over 2 GPUs; the sharded hooks run from the schedule's
reduce-scatter, outside backward, on FSDP2's streams). Skipped without CUDA and NCCL (CPU CI), where
tests/test_pipeline.py covers the same on gloo.
"""

from __future__ import annotations

import pytest
import test_pipeline
import torch
import torch.distributed as dist

NCCL = torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
GPUS = torch.cuda.device_count() if NCCL else 0


def world(n: int):
    """A world-size parameter that skips, with the reason, where this machine cannot run ``n`` NCCL ranks."""
    if not NCCL:
        why = "needs CUDA and NCCL (none in this torch build or machine); tests/test_pipeline.py covers the same on gloo"
    else:
        why = f"needs {n} GPUs, this machine has {GPUS}: NCCL runs one rank per GPU (the 1-rank case ran instead)"
    return pytest.param(n, id=f"{n}rank", marks=pytest.mark.skipif(GPUS < n, reason=why))


@pytest.fixture(scope="module")
def nccl_ranks():
    from dist_runner import Pool

    pool = Pool(backend="nccl")
    yield pool
    pool.close()


@pytest.mark.parametrize("n_ranks", [world(1), world(2)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stage_steps_in_backward_on_nccl(nccl_ranks, schedule, n_ranks):
    nccl_ranks.run(n_ranks, test_pipeline._parity, schedule=schedule, opt_name="AdamW-fused", clip="per_parameter")


@pytest.mark.parametrize("n_ranks", [world(4)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_x_fsdp2_steps_on_the_shards_on_nccl(nccl_ranks, schedule, n_ranks):
    nccl_ranks.run(n_ranks, test_pipeline._pp_fsdp2_parity, schedule=schedule, opt_name="AdamW-fused",
                   clip="per_parameter")


"""The distributed test runner itself: results come back per rank, a rank's failure is raised in the test with the
rank's traceback, a hung rank is named with its stack, a dead rank is reported, a failed group is replaced, and a
scenario that must start before the process group runs on the session's ranks."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
from dist_runner import RankDied, ScenarioTimeout

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")


def _rank_and_sum(ctx, offset):
    t = __import__("torch").tensor([ctx.rank + offset])
    dist.all_reduce(t)
    return ctx.rank, t.item()


def _fails_on_rank_1(ctx):
    assert ctx.rank != 1, "a check that failed on rank 1"


def _rank_0_waits_in_a_collective(ctx):
    if ctx.rank == 0:
        dist.barrier()  # rank 1 never joins


def _rank_1_dies(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _joins_a_group_of_its_own(ctx, leave):
    assert not dist.is_initialized() and ctx.cache == {}  # the session's group and what was cached on it are gone
    ctx.init_process_group()
    rank, total = _rank_and_sum(ctx, offset=100)
    if leave:
        dist.destroy_process_group()
    return rank, total


def test_each_rank_runs_the_scenario_and_returns_its_result(ranks):
    assert ranks.run(2, _rank_and_sum, offset=10) == [(0, 21), (1, 21)]


@pytest.mark.parametrize("leave", [False, True], ids=["group-left-up", "group-destroyed"])
def test_a_scenario_before_the_group_runs_on_the_session_ranks_which_join_a_group_again(ranks, leave):
    ranks.run(2, _cache_a_mesh)
    assert ranks.run_before_group(2, _joins_a_group_of_its_own, leave=leave) == [(0, 201), (1, 201)]
    assert ranks.run(2, _rank_and_sum, offset=10) == [(0, 21), (1, 21)]  # the same ranks, in a group again


def _cache_a_mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    ctx.cached("mesh", lambda: init_device_mesh("cpu", (ctx.world,)))


def test_a_rank_failure_is_raised_with_the_rank_traceback_and_the_group_replaced(ranks):
    with pytest.raises(AssertionError, match="a check that failed on rank 1") as info:
        ranks.run(2, _fails_on_rank_1)
    assert any("rank 1 of 2 failed in test_dist_runner._fails_on_rank_1" in n for n in info.value.__notes__)
    assert "_fails_on_rank_1" in str(info.value.__cause__)  # the rank's own traceback
    assert ranks.run(2, _rank_and_sum, offset=0) == [(0, 1), (1, 1)]  # a fresh group took over


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="the stack dump of a hung rank needs SIGUSR1 (POSIX)")
def test_a_hung_rank_is_named_with_its_stack_and_killed(ranks):
    with pytest.raises(ScenarioTimeout, match=r"ran past 5s on 2 ranks; hung: ranks \[0\]") as info:
        ranks.run(2, _rank_0_waits_in_a_collective, timeout=5)
    assert "_rank_0_waits_in_a_collective" in str(info.value) and "barrier" in str(info.value)


def test_a_dead_rank_is_reported_and_the_others_killed(ranks):
    with pytest.raises(RankDied, match=r"rank 1: killed by signal SIGKILL"):
        ranks.run(2, _rank_1_dies)

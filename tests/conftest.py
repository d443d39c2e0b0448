"""One intra-op thread per test process: `pytest -n 2` on a 2-core machine would otherwise oversubscribe it.
The ``ranks`` fixture runs scenario functions on gloo ranks kept alive for the session (tests/dist_runner.py)."""

import gc

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported at first use by DDP, FSDP2, DTensor and the planner anyway)

import dist_optim  # noqa: F401

torch.set_num_threads(1)


def _freeze() -> None:
    """Move every object alive now out of the collector's reach (gc.freeze): torch's modules and the tests' own
    are hundreds of thousands of objects, and every full collection (the tests' gc.collect(), Python's own) walked
    them all, 0.25 s a time. What the tests make after it is collected as before."""
    gc.collect()
    gc.freeze()


_freeze()
_TESTS_BETWEEN_FREEZES = 50  # modules imported by tests (transformers, torchao) join the frozen ones


def pytest_runtest_teardown(item, nextitem):
    item.session._tests_done = getattr(item.session, "_tests_done", 0) + 1
    if item.session._tests_done % _TESTS_BETWEEN_FREEZES == 0:
        _freeze()


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world, fn, **kwargs)``: ``fn(ctx, **kwargs)`` on each of ``world`` ranks; see tests/README.md."""
    from dist_runner import Pool

    pool = Pool()
    yield pool
    pool.close()


# The files whose tests launch or spawn process groups for tens of seconds, slowest first: run before the rest, so
# that under `pytest -n 2` the two workers end together on short tests instead of one waiting out the other's
# minute-long launch at the end (the order within each file is kept)
_FIRST = ("test_launch_tp.py", "test_plan_tp.py", "test_launch_pipeline.py", "test_plan_layouts.py", "test_fit.py",
          "test_launch.py", "test_bench_distributed.py", "test_plan_pipeline.py", "test_launch_memory_settings.py",
          "test_launch_plan.py", "test_docs.py", "test_bench_pipeline.py", "test_third_party.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: each file's own order kept

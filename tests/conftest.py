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

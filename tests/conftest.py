"""One intra-op thread per test process: `pytest -n 2` on a 2-core machine would otherwise oversubscribe it.
The ``ranks`` fixture runs scenario functions on gloo ranks kept alive for the session (tests/dist_runner.py)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world, fn, **kwargs)``: ``fn(ctx, **kwargs)`` on each of ``world`` ranks; see tests/README.md."""
    from dist_runner import Pool

    pool = Pool()
    yield pool
    pool.close()

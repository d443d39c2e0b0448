"""One intra-op thread per test process: `pytest -n 2` on a 2-core machine would otherwise oversubscribe it."""

import torch

torch.set_num_threads(1)

"""Where the step fires under a wrapper: the DDP comm hook, FSDP2's sharded gradients, and the seed pair.

Above the engine, below the optimizer facade: it may import ``dist_optim.engine`` and ``dist_optim._torch_internals``,
never the facade (``dist_optim.optimizer`` and its helpers), checkpoint, integrations or the planner.
"""

__all__: list[str] = []

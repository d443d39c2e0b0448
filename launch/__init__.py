"""The project's runnable programs: a small byte-level GPT trained with the optimizer step in backward, under one
process or torchrun (FSDP2, DDP), with checkpoints, resume and a side-by-side comparison with the standard loop.

Run from the repository root as a module: ``python -m launch.train`` or ``torchrun ... -m launch.train``
(the manual is :mod:`launch.train`'s docstring). It uses ``dist_optim``'s public API only.
"""

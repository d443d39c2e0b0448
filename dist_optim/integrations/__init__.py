"""Adapters that make a framework's own settings drive an ``InBackwardOptimizer``: HF ``Trainer`` and
``accelerate.Accelerator`` (:mod:`.hf_trainer`, :mod:`.hf_accelerate`), Lightning (:mod:`.lightning`) and torchtune
(:mod:`.torchtune`). Each module imports its framework when it is imported itself, never from ``import dist_optim``.
See docs/frameworks.md.
"""

__all__: list[str] = []

"""The memory planner: fake-tensor traces of both loops, layouts, pipeline stages and its command line.

Beside the library, not under it: it imports the public API and the layers below it, and nothing in the library
imports it (``dist_optim/__init__.py`` re-exports ``plan`` and its result types; ``dist_optim/plan.py`` is the
``python -m dist_optim.plan`` entry point).
"""

__all__: list[str] = []

"""``python -m dist_optim.plan``: the memory planner's command line (``--help``); in Python, ``dist_optim.plan()``.

Run, not imported: ``dist_optim.plan`` is the function, which importing this module as a submodule would hide.
"""

from __future__ import annotations

if __name__ != "__main__":
    raise ImportError("dist_optim.plan is the command line (python -m dist_optim.plan); in Python call the function "
                      "dist_optim.plan(...), whose types are dist_optim.MemoryPlan and dist_optim.LoopPlan")

from dist_optim._planner._cli import main

main()

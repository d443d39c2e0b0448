"""launch.train with faults injected through environment variables: torchrun runs this module
(``-m multinode_tests.faulty_train``) in place of ``launch.train``, so the tests can break a job at a chosen point
without launch/ knowing about them.

- ``MULTINODE_STEP_DELAY=SECONDS``: sleep before every step of a run that starts with no committed checkpoint,
  which leaves a test time to kill processes between two checkpoints; a resumed run goes at full speed. (Not
  ``TORCHELASTIC_RESTART_COUNT``: a node restarted because another node failed keeps its count at 0.)
- ``MULTINODE_KILL_RANK=R`` and ``MULTINODE_KILL_SAVE_STEP=S``: rank R writes half of its shard of checkpoint S,
  then SIGKILLs itself, as a node lost in the middle of a save would.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

from launch import train, train_loop


def _slow_steps(delay: float) -> None:
    step = train_loop.Job.step

    def slow_step(self, i):
        time.sleep(delay)
        return step(self, i)

    train_loop.Job.step = slow_step


def _die_while_saving(rank: int, save_step: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data
    folder = f"step_{save_step:08d}.partial"

    def write_half_then_die(self, plan, planner):
        if pathlib.Path(self.path).parent.name == folder:  # <name>.partial/<owner token>/
            (pathlib.Path(self.path) / f"__{rank}_0.distcp").write_bytes(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = write_half_then_die


def _fresh_start(argv: list[str]) -> bool:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run-dir", default="runs/gpt")
    run_dir = pathlib.Path(parser.parse_known_args(argv)[0].run_dir)
    return not any((run_dir / "checkpoints").glob("step_*/COMMITTED"))


def main() -> int:
    if os.environ.get("MULTINODE_STEP_DELAY") and _fresh_start(sys.argv[1:]):
        _slow_steps(float(os.environ["MULTINODE_STEP_DELAY"]))
    if os.environ.get("MULTINODE_KILL_RANK") == os.environ.get("RANK", "0"):
        _die_while_saving(int(os.environ["MULTINODE_KILL_RANK"]), int(os.environ["MULTINODE_KILL_SAVE_STEP"]))
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

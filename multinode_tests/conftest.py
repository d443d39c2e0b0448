"""Fixtures of the multinode tests: a tag that finds and kills every process a test leaves behind, and the
uninterrupted single-node 4-rank run every fault is checked against (run once per session)."""

from __future__ import annotations

import uuid

import pytest
from nodes import TRAIN_ARGS, Agent, kill_tagged, wait_all


@pytest.fixture
def tag():
    """A tag for the environment of the processes a test starts; whatever still runs afterwards is killed."""
    tag = uuid.uuid4().hex
    yield tag
    kill_tagged(tag)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``torchrun --standalone --nproc-per-node 4``: the run directory of the uninterrupted 4-rank job."""
    tmp = tmp_path_factory.mktemp("reference")
    tag = uuid.uuid4().hex
    try:
        agent = Agent("standalone", ["--standalone", "--nproc-per-node", "4"],
                      [*TRAIN_ARGS, "--run-dir", str(tmp / "run")], log_dir=tmp, tag=tag)
        wait_all(agent)
    finally:
        kill_tagged(tag)
    return tmp / "run"

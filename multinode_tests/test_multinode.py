"""launch.train as a two-node job on one machine (two torchrun agents of 2 processes each, c10d rendezvous),
checked against the single-node 4-process run, and the faults a multi-node job meets: a worker killed, a whole
node killed, a worker killed while a checkpoint is being written."""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest
from nodes import (
    FAULTY_TRAIN,
    STEPS,
    TRAIN_ARGS,
    Agent,
    checkpoint_dir,
    checkpoint_state,
    committed_steps,
    final_state,
    free_port,
    listening,
    losses,
    report,
    state_differences,
    two_node_args,
    wait_all,
    wait_for,
)

pytestmark = pytest.mark.multinode

STEP_DELAY = "0.7"  # seconds per step until the first checkpoint exists: the window in which a test kills something


def two_nodes(tmp_path, tag, run, *torchrun_extra, job="job", **kwargs) -> list[Agent]:
    """Two agents of one job (a fresh port and rendezvous id) training into ``run``; logs ``<job>-node<i>.log``.
    node1 starts once node0 serves the rendezvous store, as on a cluster where the endpoint is node0's address."""
    port, rdzv_id = free_port(), f"{job}-{tag[:12]}"
    agents = []
    for i in range(2):
        agents.append(Agent(f"{job}-node{i}", two_node_args(port, rdzv_id, *torchrun_extra),
                            [*TRAIN_ARGS, "--run-dir", str(run)], log_dir=tmp_path, tag=tag, **kwargs))
        if i == 0:
            wait_for(lambda: listening(port), f"node0 serving the rendezvous store on port {port}", *agents,
                     timeout=60)
    return agents


def resumed_from(*agents: Agent) -> list[int]:
    """The steps rank 0 said it resumed from, in the order of the attempts."""
    return [int(s) for s in re.findall(r"resumed from \S*step_(\d+) ", "".join(a.output() for a in agents))]


def test_two_nodes_train_as_the_single_node_job(tmp_path, tag, reference):
    run = tmp_path / "run"
    agents = two_nodes(tmp_path, tag, run)
    wait_all(*agents)
    output = "".join(a.output() for a in agents)
    # --resume latest without a checkpoint is a fresh start
    assert "starting fresh" in output and "4 process(es), fsdp2" in output, report(*agents)
    # the same ranks, the same batches, the same reduction: exact equality, not closeness
    assert losses(run) == losses(reference), report(*agents)
    assert not state_differences(final_state(run), final_state(reference))


def test_killed_worker_restarts_the_job_from_the_last_checkpoint(tmp_path, tag, reference):
    run = tmp_path / "run"
    # With the rendezvous store shared with the workers (torch's default), a restarted round reads the previous
    # round's gloo addresses and cannot connect, then the agents run out of restarts and hang in the rendezvous
    # (pytorch/pytorch#135712: a node restarted by a membership change keeps its restart count)
    agents = two_nodes(tmp_path, tag, run, "--max-restarts", "1", entry=FAULTY_TRAIN,
                       env={"MULTINODE_STEP_DELAY": STEP_DELAY, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    wait_for(lambda: committed_steps(run), "a committed checkpoint", *agents)
    wait_for(lambda: len(agents[1].workers()) == 2, "node1's two workers", *agents)
    os.kill(agents[1].workers()[0], signal.SIGKILL)
    at_kill = committed_steps(run)
    assert at_kill[-1] < STEPS - 1, f"the job had already finished: {at_kill}"
    wait_all(*agents)
    resumed = resumed_from(*agents)  # one restart, unless the agents went through more rendezvous rounds
    assert resumed and min(resumed) >= at_kill[-1], f"resumed from {resumed}" + report(*agents)
    assert losses(run) == losses(reference), report(*agents)
    assert not state_differences(final_state(run), final_state(reference))


def test_killed_node_resumes_on_one_node(tmp_path, tag, reference):
    run = tmp_path / "run"
    agents = two_nodes(tmp_path, tag, run, entry=FAULTY_TRAIN, env={"MULTINODE_STEP_DELAY": STEP_DELAY})
    wait_for(lambda: committed_steps(run), "a committed checkpoint", *agents)
    agents[1].kill()
    code = agents[0].wait(timeout=120)  # None: it hung and was killed, which a scheduler would do as well
    assert code != 0, f"the surviving node finished a job that lost half its ranks: exit code {code}" + report(*agents)
    last = committed_steps(run)[-1]
    assert last < STEPS - 1, f"the job had already finished: {committed_steps(run)}"

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    resumes = [Agent(f"resume-{d.name}", ["--standalone", "--nproc-per-node", "2"],
                     [*TRAIN_ARGS, "--run-dir", str(d)], log_dir=tmp_path, tag=tag) for d in (run, copy)]
    wait_all(*resumes)
    assert [resumed_from(r) for r in resumes] == [[last], [last]], report(*resumes)
    # two 1-node resumes from the same checkpoint agree bitwise
    assert losses(run) == losses(copy)
    final = final_state(run)
    assert not state_differences(final, final_state(copy))
    # the steps before the loss are the 4-rank job's; after it, 2 ranks reduce in another order: close, not equal
    ref = losses(reference)
    assert losses(run)[: last + 1] == ref[: last + 1]
    assert losses(run)[last + 1 :] == pytest.approx(ref[last + 1 :], rel=1e-5, abs=1e-6)
    assert not state_differences(final, final_state(reference), rtol=1e-4, atol=1e-5)


def test_worker_killed_during_save_leaves_the_previous_checkpoint(tmp_path, tag, reference):
    run, save_step, rank = tmp_path / "run", 5, 3
    agents = two_nodes(tmp_path, tag, run, entry=FAULTY_TRAIN,
                       env={"MULTINODE_KILL_RANK": str(rank), "MULTINODE_KILL_SAVE_STEP": str(save_step)})
    codes = wait_all(*agents, expect=None)
    assert 0 not in codes, f"exit codes {codes}" + report(*agents)
    partial = checkpoint_dir(run) / f"step_{save_step:08d}.partial"
    stagings = list(partial.iterdir())  # one staging folder per save, named by its owner token
    assert len(stagings) == 1, report(*agents)
    assert (stagings[0] / f"__{rank}_0.distcp").read_bytes() == b"half a shard", report(*agents)
    assert not (stagings[0] / "COMMITTED").exists()
    assert committed_steps(run) == [1, 3], report(*agents)
    previous = checkpoint_dir(run) / "step_00000003"
    assert not state_differences(checkpoint_state(previous, run),
                                 checkpoint_state(checkpoint_dir(reference) / previous.name, reference))

    resume = two_nodes(tmp_path, tag, run, job="resume")  # --resume latest, as every run here
    wait_all(*resume)
    assert resumed_from(*resume) == [3], report(*resume)
    assert not partial.exists() and committed_steps(run) == [1, 3, 5, 7]
    assert losses(run) == losses(reference), report(*resume)
    assert not state_differences(final_state(run), final_state(reference))

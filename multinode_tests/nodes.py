"""torchrun agents ("nodes") started from a test on one machine, the processes under them, and what their runs
leave on disk (metrics.jsonl, final checkpoints loaded into plain models in the test process).

Every process a test starts carries ``MULTINODE_TEST_TAG`` in its environment, so :func:`kill_tagged` finds the
leftovers even after their agent died and they were reparented: torchrun starts each worker in its own session,
so killing an agent's process group does not reach its workers.

Not the tests' gloo ranks (``tests/dist_runner.py``) nor the benchmarks' (``benchmarks.harness.spawn``): these are
real torchrun agents, with their rendezvous, restarts and worker processes, which is what the multinode tests test.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import torch

from launch.corpus import VOCAB_SIZE
from launch.gpt import from_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = "launch.train"  # modules torchrun runs (``-m``) from the repository root
FAULTY_TRAIN = "multinode_tests.faulty_train"
STEPS = 8
# a tiny model, few steps: 4 ranks on 2 cores; a checkpoint after steps 1, 3, 5, 7, all kept
TRAIN_ARGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
              "--corpus-mb", "0.2", "--steps", str(STEPS), "--warmup-steps", "2", "--threads", "1",
              "--log-every", "1", "--checkpoint-every", "2", "--keep-checkpoints", "10", "--resume", "latest"]
AGENT_TIMEOUT = 240  # seconds a whole job may take on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def two_node_args(port: int, rdzv_id: str, *extra: str) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *extra]


# -- processes ---------------------------------------------------------------------------------------------------
def _parent_of() -> dict[int, int]:
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
        except (OSError, IndexError):
            continue  # exited meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def children(pid: int) -> list[int]:
    return sorted(p for p, parent in _parent_of().items() if parent == pid)


def descendants(pid: int) -> list[int]:
    parents, found, todo = _parent_of(), [], [pid]
    while todo:
        pid = todo.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        todo += kids
    return sorted(found)


def _environ(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _kill_group_or_process(pid: int) -> None:
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process (and its process group) started with ``MULTINODE_TEST_TAG=tag``."""
    needle = f"MULTINODE_TEST_TAG={tag}".encode() + b"\0"
    found = [int(p.name) for p in pathlib.Path("/proc").glob("[0-9]*") if needle in _environ(int(p.name))]
    for pid in found:
        if pid != os.getpid():
            _kill_group_or_process(pid)
    return found


class Agent:
    """One ``torchrun`` agent (a node) in its own session; its output, with every worker's teed in
    (``--redirects 3 --tee 3``), goes to ``<log_dir>/<name>.log``, and per-rank files go under
    ``<log_dir>/<name>/``."""

    def __init__(self, name: str, torchrun_args: list[str], train_args: list[str], *, log_dir: pathlib.Path,
                 tag: str, entry: str = TRAIN, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "--log-dir", str(log_dir / name),
               "--redirects", "3", "--tee", "3", "-m", entry, *train_args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MULTINODE_TEST_TAG": tag,
                    "LOGLEVEL": "INFO", **(env or {})}  # LOGLEVEL: the agents log their rendezvous and restarts
        with self.log.open("w") as out:
            out.write("+ " + " ".join(cmd) + "\n")
            out.flush()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def workers(self) -> list[int]:
        """The agent's worker processes (its children that torchrun gave a LOCAL_RANK)."""
        return [p for p in children(self.proc.pid) if b"\0LOCAL_RANK=" in b"\0" + _environ(p)]

    def wait(self, timeout: float = AGENT_TIMEOUT) -> int | None:
        """The exit code, or None (after killing the node) when it has not ended within ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL the whole node at once: the agent's process group and each worker's (own) group."""
        tree = descendants(self.proc.pid)
        _kill_group_or_process(self.proc.pid)
        for pid in tree:
            _kill_group_or_process(pid)
        self.proc.wait(30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return f"== {self.log} (last {lines} lines)\n" + "\n".join(self.output().splitlines()[-lines:])


def report(*agents: Agent) -> str:
    return "\n" + "\n".join(a.tail() for a in agents)


def wait_all(*agents: Agent, expect: int | None = 0, timeout: float = AGENT_TIMEOUT) -> list[int | None]:
    """Wait for every agent (sharing one deadline); with ``expect``, assert each exited with it."""
    deadline = time.monotonic() + timeout
    codes = [a.wait(max(1.0, deadline - time.monotonic())) for a in agents]
    if expect is not None:
        assert codes == [expect] * len(agents), f"exit codes {codes}, expected {expect}" + report(*agents)
    return codes


def wait_for(condition, what: str, *agents: Agent, timeout: float = AGENT_TIMEOUT, poll: float = 0.02) -> None:
    """Poll ``condition()`` until true; fail early when an agent has already ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [a.name for a in agents if a.proc.poll() is not None]
        assert not ended and time.monotonic() < deadline, f"{what}: not seen ({ended or 'timeout'})" + report(*agents)
        time.sleep(poll)


# -- what a run leaves ------------------------------------------------------------------------------------------
def checkpoint_dir(run_dir: pathlib.Path) -> pathlib.Path:
    return run_dir / "checkpoints"


def committed_steps(run_dir: pathlib.Path) -> list[int]:
    from dist_optim.checkpoint import CheckpointManager

    return sorted(int(p.name.split("_")[1]) for p in CheckpointManager(checkpoint_dir(run_dir)).checkpoints())


def metrics(run_dir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(len(rows))), f"{run_dir}: steps {[r['step'] for r in rows]}"
    return rows


def losses(run_dir: pathlib.Path) -> list[float]:
    return [r["loss"] for r in metrics(run_dir)]


def _plain_model(run_dir: pathlib.Path) -> torch.nn.Module:
    """The run's GPT, unwrapped, on one process, built by launch's own builder from the run's config.json."""
    cfg = json.loads((run_dir / "config.json").read_text())
    return from_config(cfg, VOCAB_SIZE)


def checkpoint_state(path: pathlib.Path, run_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """Model tensors and AdamW state of the checkpoint at ``path``, loaded with ``dist_optim.checkpoint.load`` into a
    plain model and a ``torch.optim.AdamW`` in this process."""
    from dist_optim.checkpoint import load

    model = _plain_model(run_dir)
    opt = torch.optim.AdamW(model.named_parameters())
    load(path, model=model, optimizer=opt, restore_rng=False)
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            state[f"optim/{name}/{key}"] = value.clone()
    return state


def final_state(run_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    path = checkpoint_dir(run_dir) / f"step_{STEPS - 1:08d}"
    assert (path / "COMMITTED").is_file(), f"no final checkpoint {path}"
    return checkpoint_state(path, run_dir)


def state_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 0.0,
                      atol: float = 0.0) -> list[str]:
    """Names whose tensors differ (bitwise when both tolerances are 0), with the largest difference."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    out = []
    for k in sorted(a):
        same = torch.equal(a[k], b[k]) if rtol == atol == 0 else torch.allclose(a[k], b[k], rtol=rtol, atol=atol)
        if not same:
            out.append(f"{k}: max |diff| {(a[k].double() - b[k].double()).abs().max().item():.3g}")
    return out

"""Several scripts in turn on the ranks of one torchrun launch: the docs' ``<!-- torchrun N -->`` examples
(test_docs.py) and trainer runs (test_launch.py's ``_train_runs``). Interpreters, not the scripts, are what a launch
costs: two ranks and the agent import torch for ~9 CPU-s before any script runs."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each block with globals and a process group of its own: env:// on a port of its own (a TCPStore of its own, hosted
# by rank 0, instead of the agent's, which a second process group in the same processes would find holding the first
# one's keys), and Python's warnings shown again as in a process of its own ("default": once per place, per block).
# "ran NAME" on stdout and stderr after each block, on each rank: where one block's output ends; one write each, so
# that two ranks' lines never interleave.
EACH_BLOCK = """
import json, os, sys, warnings
os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
blocks, ports = json.load(open(sys.argv[1])), sys.argv[2].split(",")
for (name, code), port in zip(blocks, ports):
    os.environ["MASTER_PORT"] = port
    with warnings.catch_warnings():
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    for stream in (sys.stdout, sys.stderr):  # one write: unbuffered (PYTHONUNBUFFERED), print() writes in pieces
        stream.write(f"ran {name}\\n")
        stream.flush()
"""


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def run_blocks(blocks: list[tuple[str, str]], nproc: int | None, folder: pathlib.Path, cwd: pathlib.Path,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``blocks`` ((name, code), names unique) one after the other on the ranks of one ``torchrun --standalone
    --nproc-per-node NPROC`` job (``nproc=None``: in one plain process, no torchrun), run in ``cwd`` with the
    repository importable; the script and the blocks are written to ``folder``. A block that raises (or exits) ends
    its rank, and the launch fails."""
    (folder / "blocks.json").write_text(json.dumps(blocks))
    (folder / "each_block.py").write_text(EACH_BLOCK)
    ports = ",".join(map(str, _free_ports(len(blocks))))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [sys.executable, *launcher, str(folder / "each_block.py"), str(folder / "blocks.json"), ports],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )


def block_output(stream: str, names: list[str]) -> list[str]:
    """``stream`` (a launch's stdout or stderr) cut into each block's part: up to the first rank's "ran NAME" (every
    rank's output of a block precedes it: a trainer run ends in a barrier). The agent's own lines go with the first."""
    parts, rest = [], stream
    for name in names:
        head, sep, rest = rest.partition(f"ran {name}\n")
        assert sep, f"block {name} did not finish:\n{stream[-4000:]}"
        parts.append(head)
    return parts

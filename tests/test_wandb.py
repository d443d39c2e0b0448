"""launch.train --wandb with Weights & Biases installed (the test extra installs it), offline: every step's
metrics reach the run's own record file, read back here from its record format (no W&B server, no W&B reader)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the wandb extra is not installed")
ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
        "--corpus-mb", "0.25", "--steps", "3", "--warmup-steps", "1", "--threads", "1"]


def _records(path: pathlib.Path) -> list[bytes]:
    """The records of a W&B ``.wandb`` file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    chunks, each a CRC (4 bytes), a length (2, little-endian) and a type (1: whole, 2-4: first, middle, last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(part)
            part = b""
    return out


def test_every_step_is_logged_to_an_offline_wandb_run(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "launch.train", *TINY, "--run-dir", str(tmp_path / "r"), "--wandb",
                          "dist-optim-test"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = [], {}
    for data in _records(run):
        rec = wandb_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "run":  # the run's start: its config (the trainer's options)
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [m["step"] for m in metrics] == [0, 1, 2]
    assert [h["train/loss"] for h in history] == [m["loss"] for m in metrics]
    assert [h["train/lr"] for h in history] == [m["lr"] for m in metrics]
    assert [h["memory/memory_peak_bytes_max_rank"] for h in history] == [max(m["memory_peak_bytes"]) for m in metrics]
    assert config["n_layer"] == 2 and config["optimizer"] == "adamw"

"""launch.train, the project's main job: its command line, and real runs (one process and two torchrun gloo
ranks under FSDP2 and DDP) checked against the standard loop and against an uninterrupted run."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from launch import train
from launch.train_config import TrainConfig, parse_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ["-m", "launch.train"]  # run from the repository root, as the README does
TORCHRUN = str(pathlib.Path(sys.executable).with_name("torchrun"))
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
        "--corpus-mb", "0.25", "--steps", "6", "--warmup-steps", "2", "--threads", "1", "--log-every", "100"]


def _run(cmd: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == expect, f"{' '.join(cmd)}\nrc {out.returncode}\n{out.stdout}\n{out.stderr[-4000:]}"
    return out


def _train(tmp: pathlib.Path, run: str, *args: str, nproc: int = 1, expect: int = 0) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc)]
    return _run([*launcher, *TRAIN, *TINY, "--run-dir", str(tmp / run), *args], expect)


def _losses(tmp: pathlib.Path, run: str) -> list[float]:
    rows = [json.loads(line) for line in (tmp / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


# -- the command line -------------------------------------------------------------------------------------------
def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, f in TrainConfig.__dataclass_fields__.items():
        assert "--" + name.replace("_", "-") in out and f.metadata["help"], name
    assert "torchrun --standalone --nproc-per-node 2 -m launch.train" in train.__doc__


def test_bad_flag_is_one_line_and_exit_code_2():
    err = _run([sys.executable, *TRAIN, "--no-such-flag"], expect=2).stderr
    assert err.strip().splitlines() == ["launch.train: error: unrecognized arguments: --no-such-flag (see --help)"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--parallel", "fsdp1"], "argument --parallel: invalid choice: 'fsdp1'"),
    (["--n-embd", "30", "--n-head", "4"], "n_embd must be a multiple of n_head, got 30 and 4"),
    (["--max-grad-norm", "-1"], "max_grad_norm must be > 0 (or none), got -1.0"),
])
def test_bad_value_is_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_flags_reach_the_config():
    cfg = parse_config(["--max-grad-norm", "0.5", "--tie-weights", "false", "--compare", "--resume", "latest"])
    assert (cfg.max_grad_norm, cfg.tie_weights, cfg.compare, cfg.resume) == (0.5, False, True, "latest")
    assert parse_config(["--max-grad-norm", "none"]).max_grad_norm is None


def test_refused_settings_are_one_line_errors(tmp_path, capsys):
    run = ["--run-dir", str(tmp_path / "r")]
    assert train.main([*TINY, *run, "--batch-size", "7", "--accumulation-steps", "2"]) == 2
    assert "batch_size must be a multiple of world size x accumulation_steps = 1 x 2, got 7" in capsys.readouterr().err
    assert train.main([*TINY, *run, "--parallel", "ddp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "launch.train: error: --parallel ddp needs a process group: launch with torchrun"


# -- one process --------------------------------------------------------------------------------------------------
def test_single_process_in_backward_equals_standard_and_resumes_bitwise(tmp_path):
    opts = ["--accumulation-steps", "2", "--max-grad-norm", "0.5"]
    _train(tmp_path, "cmp", *opts, "--compare")
    report = json.loads((tmp_path / "cmp" / "compare" / "report.json").read_text())
    full = report["losses"]["in_backward"]
    assert len(full) == 6 and report["losses_bitwise_equal"] and full == report["losses"]["standard"]
    # interrupted after step 2, then resumed: the same losses as never stopping
    _train(tmp_path, "part", *opts, "--stop-after", "2", "--checkpoint-every", "2")
    assert len(_losses(tmp_path, "part")) == 3
    out = _train(tmp_path, "part", *opts, "--resume", "latest")
    assert "resumed from" in out.stderr and "step_00000002" in out.stderr
    assert _losses(tmp_path, "part") == full


# -- two torchrun processes ---------------------------------------------------------------------------------------
def _check_report(tmp: pathlib.Path, run: str, parallel: str) -> dict:
    report = json.loads((tmp / run / "compare" / "report.json").read_text())
    assert report["world_size"] == 2 and report["parallel"] == parallel
    assert report["losses_bitwise_equal"] and report["max_abs_loss_diff"] == 0.0
    for mode in ("standard", "in_backward"):
        assert len(report["peak_memory_bytes_per_rank"][mode]) == 2
        assert all(b > 0 for b in report["peak_memory_bytes_per_rank"][mode])
    assert report["step_time_ratio_in_backward_vs_standard"] > 0
    assert "Max |loss difference|" in (tmp / run / "compare" / "report.md").read_text()
    png = (tmp / run / "compare" / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    return report


def test_ddp_compare_in_backward_equals_standard(tmp_path):
    _train(tmp_path, "cmp", "--parallel", "ddp", "--accumulation-steps", "2", "--max-grad-norm", "0.5",
           "--compare", nproc=2)
    _check_report(tmp_path, "cmp", "ddp")


def test_fsdp2_compare_then_resume_on_two_and_on_one_process(tmp_path):
    # previous_norm clipping would not resume bitwise: the previous step's norm is not in the checkpoint
    opts = ["--accumulation-steps", "2", "--max-grad-norm", "0.5", "--clip-mode", "per_parameter"]
    out = _train(tmp_path, "cmp", *opts, "--compare", nproc=2)  # FSDP2 is the default on 2 processes
    report = _check_report(tmp_path, "cmp", "fsdp2")
    full = report["losses"]["in_backward"]
    assert "losses max |diff| 0" in out.stderr

    _train(tmp_path, "part", *opts, "--stop-after", "2", "--checkpoint-every", "3", nproc=2)
    shutil.copytree(tmp_path / "part", tmp_path / "part1")
    _train(tmp_path, "part", *opts, "--resume", "latest", nproc=2)
    assert _losses(tmp_path, "part") == full
    # the 2-rank checkpoint on one process: the same global batches, reduced in another order
    _train(tmp_path, "part1", *opts, "--resume", "2")
    assert _losses(tmp_path, "part1")[:3] == full[:3]
    assert _losses(tmp_path, "part1") == pytest.approx(full, rel=1e-5, abs=1e-6)

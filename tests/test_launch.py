"""launch.train, the project's main job: its command line, and real runs (one process and two torchrun gloo
ranks under FSDP2 and DDP) checked against the standard loop and against an uninterrupted run."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
from torchrun_blocks import block_output, run_blocks

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


def _main(argv: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    """``python -m launch.train ARGV`` as ``train.main(ARGV)`` in this process: the same run without the seconds a new
    interpreter spends importing torch. Its stderr as the command's would hold it: the errors and warnings printed,
    the trainer's log, and Python's warnings."""
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("train")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = train.main(argv)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    stderr = err.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                                      for w in caught)
    assert code == expect, f"launch.train {' '.join(argv)}\nrc {code}\n{stderr[-4000:]}"
    return subprocess.CompletedProcess(argv, code, "", stderr)


def _train(tmp: pathlib.Path, run: str, *args: str, nproc: int = 1, expect: int = 0, own_process: bool = False
           ) -> subprocess.CompletedProcess:
    """A run of the trainer: in this process on one (:func:`_main`), or a process of its own (``own_process``: a run
    whose compiled kernels must not depend on what this process compiled before), or under torchrun on ``nproc``."""
    argv = [*TINY, "--run-dir", str(tmp / run), *args]
    if nproc == 1 and not own_process:
        return _main(argv, expect)
    launcher = [sys.executable] if nproc == 1 else [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc)]
    return _run([*launcher, *TRAIN, *argv], expect)


def _train_runs(tmp: pathlib.Path, runs: list[tuple[str, list[str]]], nproc: int | None, expect: int = 0
                ) -> list[subprocess.CompletedProcess]:
    """Runs of the trainer (``(run, args)``, each as :func:`_train` would start it) one after the other on the ranks
    of one torchrun launch (``nproc=None``: in one process of their own, without torchrun), each
    ``launch.train.main`` with a process group of its own: the ranks' interpreters are most of a launch's CPU. Every run must succeed, or with ``expect`` (torchrun's exit code) the last one fail; each
    one's stderr. A run that resumes, or whose process history matters, goes first: a run after another in a process
    is from scratch (the trainer seeds each model)."""
    blocks = [(f"{k}-{run}", f"import sys\nfrom launch import train\ncode = train.main("
                             f"{[*TINY, '--run-dir', str(tmp / run), *args]!r})\nif code:\n    sys.exit(code)\n")
              for k, (run, args) in enumerate(runs)]
    folder = tmp / f"launch-{blocks[0][0]}"
    folder.mkdir()
    out = run_blocks(blocks, nproc, folder, cwd=ROOT, timeout=240)
    assert out.returncode == expect, f"{runs}\nrc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    finished = [name for name, _ in blocks][:len(blocks) - bool(expect)]
    parts = block_output(out.stderr, finished)
    if expect:  # the failed run's output: whatever follows the last one that finished
        parts.append(out.stderr.split(f"ran {finished[-1]}\n", 1)[1] if finished else out.stderr)
    return [subprocess.CompletedProcess(args, 0, "", err) for (_, args), err in zip(runs, parts)]


def _losses(tmp: pathlib.Path, run: str) -> list[float]:
    rows = [json.loads(line) for line in (tmp / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


def _imported(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (a folder of the repository) -> the absolute names it imports (``a.b`` for
    ``import a.b``, ``a.b.c`` for ``from a.b import c``)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_layering_holds():
    """launch uses dist_optim's public API only and nothing of benchmarks (which may import launch); dist_optim
    never imports launch or benchmarks."""
    def private(name: str) -> bool:
        return name.startswith("dist_optim.") and any(part.startswith("_") for part in name.split(".")[1:])

    launch = {f: sorted(n for n in names if n.split(".")[0] == "benchmarks" or private(n))
              for f, names in _imported("launch").items()}
    assert not {f: bad for f, bad in launch.items() if bad}
    library = {f: sorted(n for n in names if n.split(".")[0] in ("launch", "benchmarks"))
               for f, names in _imported("dist_optim").items()}
    assert not {f: bad for f, bad in library.items() if bad}


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
    (["--max-grad-norm", "-1"], "max_grad_norm must be > 0 and finite (or none), got -1.0"),
    (["--lr", "inf"], "lr must be > 0 and finite, got inf"),
    (["--beta2", "1"], "beta1 and beta2 must be in [0, 1), got 0.9 and 1.0"),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
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
    assert ("--batch-size 7 must be a multiple of the world size x --accumulation-steps = 1 x 2 = 2: pass e.g. "
            "--batch-size 8") in capsys.readouterr().err
    assert train.main([*TINY, *run, "--batch-size", "16", "--nproc", "3", "--plan"]) == 2  # torchrun's 3 processes
    assert ("--batch-size 16 must be a multiple of the world size x --accumulation-steps = 3 x 1 = 3: pass e.g. "
            "--batch-size 15") in capsys.readouterr().err
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
    # fused AdamW: 4 bytes of parameter and 8 of state a parameter (and a 4-byte step count a tensor)
    for mode in ("standard", "in_backward"):
        held = report["params_and_states_bytes_per_param"][mode][0]
        assert 12 <= held < 12.02 and report["bytes_per_param"][mode][0] > held, (mode, report["bytes_per_param"])
    # interrupted after step 2, then resumed: the same losses as never stopping
    _train(tmp_path, "part", *opts, "--stop-after", "2", "--checkpoint-every", "2")
    assert len(_losses(tmp_path, "part")) == 3
    out = _train(tmp_path, "part", *opts, "--resume", "latest")
    assert "resumed from" in out.stderr and "step_00000002" in out.stderr
    assert _losses(tmp_path, "part") == full


def test_missing_optimizer_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import fails, as when it is not installed
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--optimizer", "lion"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "launch.train: error: --optimizer lion needs the pytorch_optimizer package") and "'.[optimizers]'" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("optimizer", "module"), [("adamw8bit", "torchao.optim"), ("lion", "pytorch_optimizer")])
def test_optimizer_by_name_compares_bitwise_reports_bytes_per_param_and_resumes_exactly(optimizer, module, tmp_path):
    """The class the name maps to, in both loops: bitwise equal losses in one process (torchao's AdamW8bit and
    pytorch-optimizer's Lion step each tensor on its own: docs/optimizers.md), and bytes per parameter in the
    report: fewer than AdamW's 12 for the parameters and states (8-bit states: 2 bytes and scales where a tensor
    has 4096 elements or more, 32-bit below; Lion: one 4-byte state). A run stopped after 2 steps and resumed gives
    the losses of the run that never stopped, bitwise (torchao's quantised states go through dist_optim.checkpoint:
    codes and scales, rebuilt as the same class)."""
    pytest.importorskip(module)
    # torchao compiles its step: dynamo's recompile limit, reached in this process, would run it eagerly; its runs
    # compile afresh in processes of their own: the comparison and the stopped run in one, the resume in another
    own = module == "torchao.optim"
    runs = [("cmp", ["--optimizer", optimizer, "--compare"]),
            ("part", ["--optimizer", optimizer, "--stop-after", "2", "--checkpoint-every", "2"])]
    if own:
        _train_runs(tmp_path, runs, nproc=None)
    else:
        for run, args in runs:
            _train(tmp_path, run, *args)
    report = json.loads((tmp_path / "cmp" / "compare" / "report.json").read_text())
    assert report["config"]["optimizer"] == optimizer
    assert report["losses_bitwise_equal"] and report["max_abs_loss_diff"] == 0.0
    assert report["losses"]["in_backward"][-1] < report["losses"]["in_backward"][0]  # it trains
    held = report["params_and_states_bytes_per_param"]
    assert held["standard"] == held["in_backward"] and 6 < held["standard"][0] < 12, held
    for mode in ("standard", "in_backward"):
        counted = report["persistent_bytes_per_rank"][mode][0]
        assert counted["numel"] == 34688 and counted["params"] == 4 * counted["numel"], counted
        assert report["bytes_per_param"][mode][0] > held[mode][0]
    markdown = (tmp_path / "cmp" / "compare" / "report.md").read_text()
    assert f"## Bytes per parameter (`--optimizer {optimizer}`)" in markdown
    _train(tmp_path, "part", "--optimizer", optimizer, "--resume", "latest", own_process=own)
    assert _losses(tmp_path, "part") == report["losses"]["in_backward"]


def test_muon_for_the_matrices_compares_bitwise_with_clipping_and_resumes_exactly(tmp_path):
    """``--optimizer muon``: torch.optim.Muon for the blocks' 2-D weight matrices, fused AdamW for the rest, in a
    param group each, in backward and in the standard loop (one optimizer stepping a Muon and an AdamW optimizer over
    their groups): bitwise equal losses with global-norm clipping (the norm taken over the model's parameters in
    their order on both sides), bytes per parameter between Muon's 8 (params + momentum) and AdamW's 12, and a
    resume gives the losses of the run that never stopped. Refused where it is not built: other wrappers (one
    process only); --plan's refusal is in test_launch_plan.py."""
    opts = ("--optimizer", "muon", "--steps", "4")
    _train(tmp_path, "cmp", *opts, "--compare", "--max-grad-norm", "0.05", "--track-grad-norm")
    report = json.loads((tmp_path / "cmp" / "compare" / "report.json").read_text())
    assert report["config"]["optimizer"] == "muon"
    assert report["losses_bitwise_equal"] and report["losses"]["in_backward"][-1] < report["losses"]["in_backward"][0]
    held = report["params_and_states_bytes_per_param"]
    # 24576 of the 34688 parameters are the blocks' matrices: 4 + (24576 * 4 + 10112 * 8) / 34688
    assert held["standard"] == held["in_backward"] and abs(held["standard"][0] - 9.1684) < 1e-3, held
    _train(tmp_path, "full", *opts)
    _train(tmp_path, "part", *opts, "--stop-after", "2", "--checkpoint-every", "2")
    _train(tmp_path, "part", *opts, "--resume", "latest")
    assert _losses(tmp_path, "part") == _losses(tmp_path, "full")
    from launch.optimizers import check_parallel
    from launch.runtime import LaunchError

    for parallel in ("ddp", "fsdp2", "tp", "pp"):
        with pytest.raises(LaunchError, match=f"--optimizer muon trains on one process.*got --parallel {parallel}"):
            check_parallel("muon", parallel)
    check_parallel("adamw", "ddp")


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


def test_ddp_and_fsdp2_compare_bitwise_with_clipping_and_fsdp2_resumes_on_two_and_on_one_process(tmp_path):
    opts = ["--accumulation-steps", "2", "--max-grad-norm", "0.5", "--clip-mode", "per_parameter"]
    two_pass = ["--max-grad-norm", "0.05", "--clip-mode", "two_pass"]
    ddp = ["--parallel", "ddp"]
    # FSDP2 is the default on 2 processes; the comparisons and the stopped run share a launch, the resume has its own
    out, two_pass_out, _, ddp_two_pass_out, _ = _train_runs(tmp_path, [
        ("cmp", [*opts, "--compare"]), ("two_pass", [*two_pass, "--compare"]),
        ("ddp", [*ddp, "--accumulation-steps", "2", "--max-grad-norm", "0.5", "--compare"]),
        ("ddp_two_pass", [*ddp, *two_pass, "--compare"]),
        ("part", [*opts, "--stop-after", "2", "--checkpoint-every", "3"])], nproc=2)
    report = _check_report(tmp_path, "cmp", "fsdp2")
    full = report["losses"]["in_backward"]
    assert "losses max |diff| 0" in out.stderr
    for run, parallel, output in [("two_pass", "fsdp2", two_pass_out), ("ddp_two_pass", "ddp", ddp_two_pass_out)]:
        _check_report(tmp_path, run, parallel)
        assert "losses max |diff| 0" in output.stderr
    _check_report(tmp_path, "ddp", "ddp")

    _check_ranks_memory(tmp_path, "part", "in_backward")
    shutil.copytree(tmp_path / "part", tmp_path / "part1")
    _train(tmp_path, "part", *opts, "--resume", "latest", nproc=2)
    assert _losses(tmp_path, "part") == full
    # the 2-rank checkpoint on one process: the same global batches, reduced in another order
    _train(tmp_path, "part1", *opts, "--resume", "2")
    assert _losses(tmp_path, "part1")[:3] == full[:3]
    assert _losses(tmp_path, "part1") == pytest.approx(full, rel=1e-5, abs=1e-6)


# -- the run directory: fresh, resumed, overwritten ----------------------------------------------------------------
def _steps_on_disk(tmp: pathlib.Path, run: str) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (tmp / run / "checkpoints").glob("step_*")
                  if (p / "COMMITTED").is_file())


def _files(tmp: pathlib.Path, run: str) -> dict[str, bytes]:
    return {str(p.relative_to(tmp / run)): p.read_bytes() for p in sorted((tmp / run).rglob("*")) if p.is_file()}


def test_fresh_run_over_checkpoints_is_refused_and_overwrite_replaces_them(tmp_path):
    _train(tmp_path, "r", "--checkpoint-every", "2")  # checkpoints 1, 3, 5
    before = _files(tmp_path, "r")
    # another run into the same directory: refused before anything there is touched (metrics, config, checkpoints)
    err = _train(tmp_path, "r", "--checkpoint-every", "2", "--seed", "1", expect=2).stderr
    assert err.strip().splitlines()[-1] == (
        f"launch.train: error: {tmp_path / 'r' / 'checkpoints'} holds the checkpoints of another run (steps 1, 3, 5); "
        "a fresh run would delete them: resume it with --resume latest, train in another --run-dir, or pass "
        "--overwrite to delete them and start fresh")
    assert _files(tmp_path, "r") == before
    # --overwrite: the new run's checkpoints only, the last one kept even with keep_last 1
    _train(tmp_path, "r", "--checkpoint-every", "2", "--keep-checkpoints", "1", "--seed", "1", "--overwrite")
    assert _steps_on_disk(tmp_path, "r") == [5]
    _train(tmp_path, "fresh", "--seed", "1")
    assert _losses(tmp_path, "r") == _losses(tmp_path, "fresh")


def test_resume_from_an_older_checkpoint_keeps_the_checkpoints_it_writes(tmp_path):
    _train(tmp_path, "r", "--checkpoint-every", "2")  # checkpoints 1, 3, 5
    full = _losses(tmp_path, "r")
    err = _train(tmp_path, "r", "--checkpoint-every", "2", "--resume", "1", expect=2).stderr
    assert "holds later checkpoints (steps 3, 5) that this run would write over" in err
    assert _steps_on_disk(tmp_path, "r") == [1, 3, 5]
    _train(tmp_path, "r", "--checkpoint-every", "2", "--resume", "1", "--overwrite")
    assert _steps_on_disk(tmp_path, "r") == [1, 3, 5] and _losses(tmp_path, "r") == full


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "1000000"], "block_size + 2 = 1000002 bytes must fit in the corpus, which has 262144"),
    (["--resume", "7"], "--resume 7: no committed checkpoint at"),
    (["--resume", "/no/such/checkpoint"], "--resume /no/such/checkpoint: no committed checkpoint at"),
    (["--overwrite", "--compare"], "--compare trains two jobs from scratch"),
])
def test_unusable_settings_are_one_line_errors(argv, message, tmp_path, capsys):
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("launch.train: error: ") and message in err


def test_lr_inf_is_refused_and_a_diverged_run_stops_with_exit_code_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--lr", "inf"])
    assert exc.value.code == 2 and "lr must be > 0 and finite, got inf" in capsys.readouterr().err
    # finite, but far too large: the loss turns NaN at step 1
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--lr", "1e30", "--checkpoint-every", "1"]) == 1
    err = capsys.readouterr().err
    assert "launch.train: error: the loss is nan at step 1 (lr 6.67e+29): the run diverged" in err
    assert not all(map(math.isfinite, _losses(tmp_path, "r")))
    assert _steps_on_disk(tmp_path, "r") == [0]  # no checkpoint of the diverged state


# -- options on resume --------------------------------------------------------------------------------------------
def test_resume_applies_schedule_options_and_refuses_a_new_model_shape(tmp_path):
    _train(tmp_path, "r", "--stop-after", "2", "--checkpoint-every", "3")
    err = _train(tmp_path, "r", "--resume", "latest", "--n-embd", "64", expect=2).stderr
    assert "the checkpoint's model has --n-embd 32 (now 64): a resume keeps the model's shape" in err
    if importlib.util.find_spec("pytorch_optimizer") is not None:
        err = _train(tmp_path, "r", "--resume", "latest", "--optimizer", "lion", expect=2).stderr
        assert "the checkpoint's optimizer states are --optimizer adamw's (now lion): a resume keeps" in err
    out = _train(tmp_path, "r", "--resume", "latest", "--lr", "0.001", "--weight-decay", "0.5")
    assert "in effect from step 3: --lr 0.003 -> 0.001, --weight-decay 0.1 -> 0.5" in out.stderr
    assert json.loads((tmp_path / "r" / "config.json").read_text())["lr"] == 0.001
    # from step 3 on, the lr of a run started with --lr 0.001 (the same schedule)
    _train(tmp_path, "new", "--lr", "0.001", "--weight-decay", "0.5")
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    new = [json.loads(line)["lr"] for line in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[3:] == new[3:] and lrs[:3] != new[:3]


@pytest.mark.parametrize("mode", ["in_backward", "standard"])
def test_previous_norm_clipping_resumes_exactly_without_a_warning(mode, tmp_path):
    opts = ["--max-grad-norm", "0.05", "--clip-mode", "previous_norm", "--optimizer-mode", mode]
    _train(tmp_path, "full", *opts)
    _train(tmp_path, "part", *opts, "--stop-after", "2", "--checkpoint-every", "3")
    out = _train(tmp_path, "part", *opts, "--resume", "latest")
    assert "resumed from" in out.stderr and "WARNING" not in out.stderr.upper() and "not clipped" not in out.stderr
    assert _losses(tmp_path, "part") == _losses(tmp_path, "full")


# -- SIGTERM ------------------------------------------------------------------------------------------------------
def _worker(agent: subprocess.Popen, local_rank: int, timeout: float = 120) -> int:
    """The pid of the agent's worker ``local_rank`` (read from /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                env = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            if parent == agent.pid and f"LOCAL_RANK={local_rank}".encode() in env:
                return int(stat.parent.name)
        time.sleep(0.05)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under torchrun {agent.pid}")


def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_resumes_exactly(tmp_path):
    """The uninterrupted run is the standard loop's (in backward equals it bitwise: the --compare tests), whose
    metrics carry each rank's memory (in backward: test_fsdp2_compare_then_resume_on_two_and_on_one_process's run);
    one 2-rank launch checks both, and the resume's launch runs it after the resume."""
    opts = ["--steps", "60", "--batch-size", "32", "--log-every", "1"]
    run = tmp_path / "run"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *TRAIN, *TINY, *opts, "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as agent:
        try:
            rank1 = _worker(agent, 1)
            metrics = run / "metrics.jsonl"
            while agent.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
                time.sleep(0.02)
            os.kill(rank1, signal.SIGTERM)  # a scheduler may signal only some of the processes, at any step
            output, _ = agent.communicate(timeout=240)
        finally:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    stopped = [int(s) for s in re.findall(r"SIGTERM: stopped after step (\d+)", output)]
    assert len(stopped) == 1 and stopped[0] < 59, output[-4000:]
    assert _steps_on_disk(tmp_path, "run") == stopped and len(_losses(tmp_path, "run")) == stopped[0] + 1
    _train_runs(tmp_path, [("run", [*opts, "--resume", "latest"]), ("full", [*opts, "--optimizer-mode", "standard"])],
                nproc=2)
    _check_ranks_memory(tmp_path, "full", "standard")
    assert _losses(tmp_path, "run") == _losses(tmp_path, "full"), "stopped by SIGTERM and resumed in backward != " \
        "the standard loop's uninterrupted run"


# -- at the terminal ------------------------------------------------------------------------------------------------
def _interrupt(tmp_path: pathlib.Path, run: str, opts: list[str], signals: int) -> tuple[int, str]:
    """Start a one-process run and send it a Ctrl-C (SIGINT) once it has logged 3 steps; with ``signals=2`` a second
    one as soon as it says it heard the first (Python runs one handler for two signals that arrive before it, so the
    second waits for the first's line). Its exit code and output."""
    cmd = [sys.executable, *TRAIN, *TINY, *opts, "--run-dir", str(tmp_path / run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            sent = 0
            for line in p.stdout:
                lines.append(line)
                logged = sum(t.startswith("step ") for t in lines)
                if sent == 0 and logged >= 3 or sent == 1 < signals and line.startswith("Ctrl-C: stopping"):
                    p.send_signal(signal.SIGINT)
                    sent += 1
            p.wait(timeout=240)
        finally:
            p.kill()
    return p.returncode, "".join(lines)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(tmp_path):
    opts = ["--steps", "60", "--log-every", "1"]
    _train(tmp_path, "full", *opts)
    code, output = _interrupt(tmp_path, "run", opts, signals=1)
    assert code == 0 and "Traceback" not in output, output[-4000:]
    assert "Ctrl-C: stopping after this step with a checkpoint (press Ctrl-C again to abort at once)" in output
    stopped = [int(s) for s in re.findall(r"Ctrl-C: stopped after step (\d+) with a checkpoint; continue with "
                                          r"--resume latest", output)]
    assert len(stopped) == 1 and stopped[0] < 59, output[-4000:]
    assert f"checkpoint: step {stopped[0]} saved in" in output
    assert _steps_on_disk(tmp_path, "run") == stopped
    _train(tmp_path, "run", *opts, "--resume", "latest")
    assert _losses(tmp_path, "run") == _losses(tmp_path, "full")


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    # steps of ~0.1 s, so that the second Ctrl-C lands before the first's step and checkpoint are done
    slower = ["--n-embd", "128", "--block-size", "128", "--batch-size", "16", "--steps", "200", "--log-every", "1"]
    code, output = _interrupt(tmp_path, "run", slower, signals=2)
    assert code != 0 and "stopped after step" not in output, output[-4000:]
    assert not (tmp_path / "run" / "checkpoints").exists() or _steps_on_disk(tmp_path, "run") == []


def test_a_bug_on_one_rank_ends_the_job_at_once_with_its_traceback(tmp_path):
    # rank 1 raises while rank 0 waits for it in a collective: rank 1 leaves without the barrier that would wait for
    # rank 0 for the group's 10 minutes, rank 0's collective fails, and torchrun ends the job
    argv = [*TINY, "--run-dir", str(tmp_path / "r"), "--parallel", "ddp"]
    code = ("import os, sys\nfrom launch import train\nif os.environ['RANK'] == '1':\n"
            "    def broken(*args, **kwargs):\n        raise RuntimeError('a bug on rank 1')\n"
            f"    train.Job = broken\nsys.exit(train.main({argv!r}))\n")
    out = run_blocks([("bug", code)], 2, tmp_path, cwd=ROOT, timeout=120)  # the hang: TimeoutExpired here
    assert out.returncode != 0, out.stderr[-3000:]
    assert "[rank1]: RuntimeError: a bug on rank 1" in out.stderr, out.stderr[-3000:]


def test_stop_after_saves_a_checkpoint_to_resume_from(tmp_path):
    _train(tmp_path, "full")
    out = _train(tmp_path, "part", "--stop-after", "2")  # no --checkpoint-every
    assert "checkpoint: step 2 saved in" in out.stderr
    assert _steps_on_disk(tmp_path, "part") == [2]
    out = _train(tmp_path, "part", "--resume", "latest")
    assert "resumed from" in out.stderr
    assert _losses(tmp_path, "part") == _losses(tmp_path, "full")


def test_an_underscored_flag_names_the_flag_meant(capsys):
    from launch.train_config import parse_config

    with pytest.raises(SystemExit) as exit_:
        parse_config(["--max_grad_norm", "1.0"])
    assert exit_.value.code == 2
    assert "unrecognized argument --max_grad_norm: did you mean --max-grad-norm?" in capsys.readouterr().err
    assert parse_config(["--max-grad", "1.0"]).max_grad_norm == 1.0  # argparse's own abbreviation still works


def test_a_warm_up_longer_than_the_run_is_fitted_to_it_with_a_warning(tmp_path):
    out = _train(tmp_path, "r", "--steps", "10", "--warmup-steps", "50", "--log-every", "1")
    assert ("launch.train: warning: --warmup-steps 50 is not below --steps 10: the whole run would be warm-up, lr "
            "never reaching --lr; warming up over 1 steps") in out.stderr
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(lrs) == pytest.approx(3e-3)  # --lr reached after the one warm-up step
    assert lrs[-1] < max(lrs)  # and the cosine decay ran


def test_resuming_a_finished_run_says_it_is_finished(tmp_path):
    _train(tmp_path, "r", "--checkpoint-every", "3")
    out = _train(tmp_path, "r", "--resume", "latest")
    assert "done: the run in" in out.stderr and "is finished (its checkpoint is of step 5, the last of --steps 6)" \
        in out.stderr
    assert "steps 6 to 5" not in out.stderr


def _check_ranks_memory(tmp: pathlib.Path, run: str, mode: str) -> None:
    """Each metrics row of a 2-rank FSDP2 run carries each rank's memory."""
    rows = [json.loads(line) for line in (tmp / run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert len(row["grad_bytes_peak"]) == 2 and len(row["memory_peak_bytes"]) == 2, row
        assert all(b > 0 for b in row["grad_bytes_peak"]) and all(m > 0 for m in row["memory_peak_bytes"]), row
    # FSDP2: each rank holds its shards' gradients; in backward a bucket at a time, in the standard loop all of them
    held = rows[-1]["grad_bytes_peak"]
    if mode == "standard":
        assert held[0] == pytest.approx(held[1], rel=0.2)


def test_the_progress_line_says_the_time_left(tmp_path):
    out = _train(tmp_path, "r", "--log-every", "1")
    lines = [line for line in out.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == 6 and all(re.search(r"  eta \d+:\d\d:\d\d$", line) for line in lines[:-1]), lines
    assert "eta" not in lines[-1]


def test_resume_without_the_shape_flags_reads_them_from_the_run(tmp_path):
    _train(tmp_path, "full")
    _train(tmp_path, "part", "--stop-after", "2")
    shape = {"--n-layer", "--n-head", "--n-embd", "--block-size"}
    rest = [a for i, a in enumerate(TINY) if a not in shape and (i == 0 or TINY[i - 1] not in shape)]
    out = _main([*rest, "--run-dir", str(tmp_path / "part"), "--resume", "latest"])
    assert "resumed from" in out.stderr and "options changed" not in out.stderr
    # no flag but this launch's: the run's options, from its config.json; Ctrl-C's "continue with --resume latest"
    _train(tmp_path, "again", "--stop-after", "2")
    out = _main(["--threads", "1", "--run-dir", str(tmp_path / "again"), "--resume", "latest"])
    assert "resumed from" in out.stderr and "options changed" not in out.stderr
    assert _losses(tmp_path, "again") == _losses(tmp_path, "full")
    assert _losses(tmp_path, "part") == _losses(tmp_path, "full")
    out = _train(tmp_path, "part", "--resume", "latest", "--n-layer", "3", expect=2)  # a shape given is compared
    assert "the checkpoint's model has --n-layer 2 (now 3)" in out.stderr


def test_resume_latest_without_a_checkpoint_restarts_the_run_and_never_replaces_another(tmp_path):
    """A run that saved no checkpoint: ``--resume latest`` restarts it only where it did not finish (torchrun's
    restart before the first checkpoint), with its own options; a finished one has nothing to resume, and other
    options would be another job over the run's metrics: each refused in one line, nothing written."""
    _train(tmp_path, "r", "--steps", "2", "--warmup-steps", "0")
    held = {name: (tmp_path / "r" / name).read_text() for name in ("metrics.jsonl", "config.json")}
    resume = ["--threads", "1", "--run-dir", str(tmp_path / "r"), "--resume", "latest"]
    err = _main(resume, expect=2).stderr
    assert err.startswith(f"launch.train: error: --resume latest: the run in {tmp_path / 'r'} finished (step 1, "
                          "the last of --steps 2) without saving a checkpoint") and len(err.splitlines()) == 1, err
    err = _main([*resume, "--batch-size", "4"], expect=2).stderr
    assert err.startswith(f"launch.train: error: --resume latest: {tmp_path / 'r' / 'checkpoints'} holds no "
                          "checkpoint, so this would start fresh, but") and len(err.splitlines()) == 1, err
    assert "--batch-size 8 (now 4)" in err and "pass --overwrite" in err
    assert {name: (tmp_path / "r" / name).read_text() for name in held} == held
    (tmp_path / "r" / "metrics.jsonl").write_text(held["metrics.jsonl"].splitlines()[0] + "\n")  # died after step 0
    out = _main(resume)
    assert "no checkpoint in" in out.stderr and "starting fresh" in out.stderr
    assert _losses(tmp_path, "r") == [json.loads(line)["loss"] for line in held["metrics.jsonl"].splitlines()]


def test_compare_into_a_training_runs_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    _train(tmp_path, "r", "--steps", "2", "--warmup-steps", "0")
    config = (tmp_path / "r" / "config.json").read_text()
    assert train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--compare"]) == 2
    assert (f"--compare: {tmp_path / 'r'} holds a training run (metrics.jsonl), whose config.json it would overwrite; "
            "compare in another --run-dir") in capsys.readouterr().err
    assert (tmp_path / "r" / "config.json").read_text() == config  # nothing written


# -- what a run reports besides metrics.jsonl -------------------------------------------------------------------------
def test_tensorboard_when_asked_writes_every_steps_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (in the test extra) is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path, "r", "--tensorboard")
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx(_losses(tmp_path, "r"))
    assert len(events.Scalars("memory/grad_bytes_peak_max_rank")) == 6


def test_a_reporter_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    for name in ("tensorboard", "torch.utils.tensorboard", "wandb"):  # imports fail, as when not installed
        monkeypatch.setitem(sys.modules, name, None)
    for flags, line in [(["--tensorboard"], "launch.train: error: --tensorboard needs TensorBoard, which is not "
                                            "installed: pip install -c constraints.txt -e '.[tensorboard]'"),
                        (["--wandb", "proj"], "launch.train: error: --wandb proj needs Weights & Biases, which is "
                                              "not installed: pip install -c constraints.txt -e '.[wandb]'")]:
        out = _train(tmp_path, "r", *flags, expect=2)
        assert out.stderr.strip().splitlines()[-1].startswith(line), out.stderr[-2000:]
        assert not (tmp_path / "r" / "metrics.jsonl").exists()

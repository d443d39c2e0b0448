"""launch.train's memory settings, the ones ``--fit`` chooses among: ``--checkpoint-blocks`` (activation
checkpointing per block), ``--param-dtype bfloat16`` and ``--autocast bfloat16``, each compared with the standard
loop under the same setting (``--compare``), on one process and on two FSDP2 ranks under torchrun."""

from __future__ import annotations

import json
import pathlib

import pytest
from test_launch import _train, _train_runs

from launch.train_config import parse_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _report(tmp: pathlib.Path, run: str) -> dict:
    return json.loads((tmp / run / "compare" / "report.json").read_text())


def test_each_setting_compares_bitwise_on_one_process(tmp_path):
    _train(tmp_path, "plain", "--compare", "--steps", "3")
    plain = _report(tmp_path, "plain")["losses"]["standard"]
    # checkpointing recomputes the same values: the losses are those of the run without it, in both loops
    _train(tmp_path, "ckpt", "--compare", "--steps", "3", "--checkpoint-blocks", "2")
    ckpt = _report(tmp_path, "ckpt")
    assert ckpt["losses_bitwise_equal"] and ckpt["losses"]["in_backward"] == plain
    _train(tmp_path, "bf16", "--compare", "--steps", "3", "--param-dtype", "bfloat16", "--checkpoint-blocks", "1",
           "--max-grad-norm", "0.5", "--clip-mode", "two_pass")
    bf16 = _report(tmp_path, "bf16")
    assert bf16["losses_bitwise_equal"] and bf16["losses"]["in_backward"] != plain
    # bf16 parameters and state: 2 bytes of parameter and 4 of AdamW's state a parameter
    held = bf16["params_and_states_bytes_per_param"]["in_backward"][0]
    assert 6 <= held < 6.02, held
    _train(tmp_path, "amp", "--compare", "--steps", "3", "--autocast", "bfloat16")
    amp = _report(tmp_path, "amp")
    assert amp["losses_bitwise_equal"] and amp["losses"]["in_backward"] != plain
    assert 12 <= amp["params_and_states_bytes_per_param"]["in_backward"][0] < 12.02  # fp32 kept


def test_two_fsdp2_ranks_settings_compare_bitwise_keep_the_saving_and_a_pipeline_refuses_autocast(tmp_path):
    # one launch; the run whose output must lack a warning first, as in a process of its own; the refused run last,
    # as it ends the launch: torchrun's code 1, a rank failed
    plain, out, pp = _train_runs(tmp_path, [
        ("plain", ["--steps", "2"]),
        ("fsdp2", ["--compare", "--steps", "3", "--checkpoint-blocks", "2", "--param-dtype", "bfloat16",
                   "--accumulation-steps", "2"]),
        ("pp", ["--parallel", "pp", "--tie-weights", "false", "--autocast", "bfloat16"])], nproc=2, expect=1)
    report = _report(tmp_path, "fsdp2")
    assert report["losses_bitwise_equal"] and len(report["losses"]["in_backward"]) == 3
    # accumulation holds every gradient (FSDP2's unsharded ones): said once per rank
    assert out.stderr.count("holds every gradient of the step") == 2
    # without accumulation, no warning: the root unit's unsharded gradients, made first in every backward, are not
    # an accumulation
    assert "done: steps 0 to 1" in plain.stderr and "holds every gradient" not in plain.stderr
    assert "--autocast bfloat16 with --parallel pp" in pp.stderr and "--param-dtype bfloat16" in pp.stderr


def test_a_resume_keeps_the_parameter_dtype_and_may_change_checkpointing(tmp_path):
    _train(tmp_path, "r", "--param-dtype", "bfloat16", "--stop-after", "2")
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["param_dtype"] == "bfloat16"
    # not given again: read from the run's config; checkpointing is the process's choice
    out = _train(tmp_path, "r", "--resume", "latest", "--checkpoint-blocks", "2")
    assert "resumed from" in out.stderr
    out = _train(tmp_path, "r", "--resume", "latest", "--param-dtype", "float32", expect=2)
    assert "--param-dtype bfloat16 (now float32)" in out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--n-layer", "2", "--checkpoint-blocks", "3"], "checkpoint_blocks must be in [0, n_layer=2], got 3"),
    (["--autocast", "float16"], "argument --autocast: invalid choice: 'float16'"),
    (["--param-dtype", "float64"], "argument --param-dtype: invalid choice: 'float64'"),
])
def test_bad_values_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err

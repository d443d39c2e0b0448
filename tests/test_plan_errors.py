"""The planner on inputs it cannot plan as given (issue 34): the command line answers each bad input in one line with
exit code 2, naming the flag and the fix; a job that cannot run is refused; an operator that cannot run on fake
tensors is one line naming it, its module and the way out; a module built by copy.deepcopy plans."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import dist_optim
from dist_optim._planner._cli import Refused, main
from dist_optim._planner._guard import UnplannableOperator

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT = ["--model", "launch.gpt:GPT", "--model-kwargs",
       json.dumps({"vocab_size": 64, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32})]


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_optim.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_a_bad_input_is_one_line_and_exit_code_2_in_a_real_process():
    proc = _cli(["--model", "launch.gpt:Nope", "--vocab-size", "8"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "python -m dist_optim.plan: error: --model launch.gpt:Nope: 'launch.gpt' has no 'Nope'; give an existing "
        "MODULE:NAME"]


@pytest.mark.parametrize("args, match", [
    (["--hf-config", "/no/such/config.json"], r"^--hf-config /no/such/config.json: no such file; give a config"),
    (["--model", "no_such_module:GPT", "--vocab-size", "8"], r"^--model no_such_module:GPT: cannot import"),
    (["--model", "GPT", "--vocab-size", "8"], r"^--model GPT: expected MODULE:NAME"),
    (["--model", "launch.gpt:GPT", "--model-kwargs", "{vocab_size: 8}"], r"^--model-kwargs: malformed JSON"),
    (["--model", "launch.gpt:GPT", "--model-kwargs", "[1]"], r"^--model-kwargs: expected a JSON object, got list"),
    ([*GPT, "--world", "0"], r"^argument --world: expected a whole number >= 1, got '0' \(see --help\)"),
    ([*GPT, "--batch-size", "two"], r"^argument --batch-size: expected a whole number >= 1"),
    ([*GPT, "--optimizer", "torch.optim.Nope"], r"^--optimizer torch.optim.Nope: 'torch.optim' has no 'Nope'"),
    ([*GPT, "--seq-len", "64"], r"^--seq-len 64 is above the model's 32 positions .* give --seq-len 32 or less"),
    ([*GPT, "--world", "3", "--parallel", "hsdp", "--shard-size", "2"], r"needs shard_size.*world_size \(3\).*got 2$"),
])
def test_each_bad_input_is_refused_in_one_line_naming_the_flag(args, match, capsys):
    with pytest.raises(Refused, match=match) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m dist_optim.plan: error: "), err


def test_a_malformed_or_unknown_hugging_face_config_is_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(Refused, match=rf"^--hf-config {bad}: malformed JSON"):
        main(["--hf-config", str(tmp_path)])  # the folder: its config.json
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(Refused, match=r"not a config transformers can read .*give a model's config.json"):
        main(["--hf-config", str(bad)])


def test_a_missing_optional_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(Refused, match=r"--hf-config needs transformers.*pip install 'dist_optim\[hf\]'"):
        main(["--hf-config", str(tmp_path / "config.json")])


def test_plot_without_matplotlib_prints_the_table_and_says_how_to_get_the_picture(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    main([*GPT, "--plot", str(tmp_path / "plan.png"), "--quiet"])
    out, err = capsys.readouterr()
    assert "saving:" in out and not (tmp_path / "plan.png").exists()
    assert "matplotlib is not installed" in err and "pip install 'dist_optim[job]'" in err


def test_the_sequence_length_defaults_to_the_models_positions_and_progress_goes_to_stderr(capsys):
    p = main(GPT)  # block_size 32 in --model-kwargs
    out, err = capsys.readouterr()
    assert p.options["seq_len"] == 32
    assert "tracing the standard loop" in err and "tracing the in backward loop" in err and "tracing" not in out
    p = main(["--model", "launch.gpt:GPT", "--vocab-size", "64", "--quiet", "--model-kwargs",
              json.dumps({"vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16})])
    assert p.options["seq_len"] == 16 and capsys.readouterr().err == ""


def test_help_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--seq-len", "--vocab-size", "--ddp-bucket-cap-mb", "--backend", "--parallelize", "--lr"):
        text = out.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert text.count("default") <= 1, (flag, text)
    assert "(default: None)" not in out and "(default: False)" not in out


class _Router(nn.Module):  # data-dependent routing: the selected rows' count depends on the values
    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(x[x.sum(-1) > 0])


def test_an_operator_that_cannot_run_on_fake_tensors_is_one_line_naming_it_its_module_and_the_way_out():
    model = lambda: nn.Sequential(nn.Linear(8, 8), _Router())  # noqa: E731
    with pytest.raises(UnplannableOperator) as e:
        dist_optim.plan(model, lambda: torch.randn(4, 8), lambda m, x: m(x).sum(), lr=1e-3)
    message = str(e.value)
    assert "\n" not in message and e.value.__cause__ is None and e.value.__suppress_context__
    assert message.startswith("aten.") and "called from 1 (_Router)" in message
    assert "DynamicOutputShapeException" in message and "the way out:" in message and "MoE" in message


def test_a_module_built_by_deepcopy_plans_and_agrees_with_its_layers_built_apart():
    def encoder() -> nn.Module:  # nn.TransformerEncoder deep-copies its layer
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 2,
                                     enable_nested_tensor=False)

    def apart() -> nn.Module:
        return nn.Sequential(*(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True) for _ in range(2)))
    args = (lambda: torch.randn(2, 8, 32), lambda m, x: m(x).square().mean())
    copied, built = dist_optim.plan(encoder, *args, lr=1e-3), dist_optim.plan(apart, *args, lr=1e-3)
    assert copied.n_params == built.n_params > 0
    assert [lp.peak_bytes for lp in copied.loops()] == [lp.peak_bytes for lp in built.loops()]


def test_engine_options_default_to_the_engines_and_unmodelled_ones_are_refused():
    args = (lambda: nn.Linear(8, 8), lambda: torch.randn(2, 8), lambda m, x: m(x).sum())
    assert dist_optim.plan(*args, lr=1e-3).options["bucket_cap_mb"] == dist_optim.InBackwardOptions().bucket_cap_mb
    with pytest.raises(NotImplementedError, match="does not model the engine option.* max_grad_value"):
        dist_optim.plan(*args, max_grad_value=1.0, lr=1e-3)
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got 0"):
        dist_optim.plan(*args, bucket_cap_mb=0, lr=1e-3)


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 64}


def test_an_moe_whose_grouped_experts_take_bf16_only_plans_in_bf16_and_says_so_in_fp32(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    p = main(["--hf-config", str(path), "--batch-size", "2", "--dtype", "bfloat16", "--quiet"])
    assert p.options["seq_len"] == 64 and p.standard.peak_bytes > 0  # max_position_embeddings
    capsys.readouterr()
    with pytest.raises(Refused, match=r"aten._grouped_mm.* called from model.layers.0.mlp.experts \(MixtralExperts\): "
                                      r"RuntimeError: Expected inputs of BF16 type.*--dtype bfloat16"):
        main(["--hf-config", str(path), "--batch-size", "2", "--quiet"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # torch's own log of the failing meta kernel: filtered

"""Make it fit: ``dist_optim.fit``, ``python -m dist_optim.plan --fit`` and ``launch.train --fit``, the recommended
setting run for real (each rank's peak over the whole run, first step included, measured by benchmarks/heap_shim.c
on every thread) at or under the budget and within 10 % of its plan; a setting rejected as over the budget measures
over it; a budget under every candidate exits 3 naming the smallest."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from test_launch import ROOT, TORCHRUN

import dist_optim
from benchmarks.harness import build_shim
from launch.memory_peak import allocator_peak

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MiB = 2**20
SHAPE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--batch-size", "8"]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))


def _fit(**kw):
    return dist_optim.fit(_mlp, lambda n: torch.randn(n, 256), lambda m, x: m(x).square().mean(),
                          global_batch=16, lr=1e-3, **kw)


def test_traced_candidates_are_the_planners_figures_and_derived_ones_are_close():
    r = _fit(memory="64MiB", verify=0)
    assert len(r.candidates) == 5 and r.fits  # micro 1, 2, 4, 8, 16
    for c in r.candidates:
        s = c.setting
        p = dist_optim.plan(_mlp, lambda: torch.randn(s.micro_batch, 256), lambda m, x: m(x).square().mean(),
                            accumulation_steps=s.accumulation_steps, lr=1e-3).in_backward
        assert c.setting.micro_batch * c.setting.accumulation_steps == 16
        if c.planned_by == "traced":
            assert c.planned_peak_bytes == p.run_peak_bytes
        else:  # interpolated between its group's traced micro-batches
            assert c.planned_by == "derived" and abs(c.planned_peak_bytes - p.run_peak_bytes) < 0.1 * p.run_peak_bytes
    # the ranking: those that fit cheapest first (ties: smaller peak)
    assert [c.fits for c in r.candidates] == sorted((c.fits for c in r.candidates), reverse=True)


def test_a_budget_between_the_candidates_splits_them_and_none_fits_below_the_smallest():
    every = _fit(memory="64MiB")
    peaks = sorted(c.planned_peak_bytes for c in every.candidates)
    budget = (peaks[0] + peaks[-1]) // 2
    r = _fit(memory=budget, headroom=0.0)
    assert r.fits and 0 < sum(c.fits for c in r.candidates) < len(r.candidates)
    assert all(c.fits == (c.planned_peak_bytes <= budget) for c in r.candidates)
    assert r.best.planned_by == "traced" and r.best.planned_peak_bytes <= budget
    assert "InBackwardOptimizer(model, torch.optim.adamw.AdamW" in r.best.call
    none = _fit(memory=peaks[0] - 1, headroom=0.0)
    assert not none.fits and none.best is None and none.smallest_peak_bytes == peaks[0]
    assert "nothing fits" in none.table()


def test_allowed_settings_are_named_and_reordered_draws_reach_the_call():
    r = _fit(memory="64MiB", allow="bf16-params,reordered-draws")
    needs = {tuple(c.setting.needs()) for c in r.candidates}
    assert needs == {("reordered-draws",), ("bf16-params", "reordered-draws")}
    assert all("random_draws='reordered'" in c.call for c in r.candidates)
    bf16 = [c for c in r.candidates if c.setting.param_dtype == "bfloat16"]
    assert bf16 and all("model.to(torch.bfloat16)" in c.call and "needs bf16-params" in r.table(len(r.candidates))
                        for c in bf16)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="allow names 'fp8'"):
        _fit(memory="1GiB", allow="fp8")
    with pytest.raises(ValueError, match="memory must be a positive size such as 80GiB"):
        _fit(memory="lots")
    with pytest.raises(ValueError, match="devices must be an integer >= 1, got 0"):
        _fit(memory="1GiB", devices=0)


HF_CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=64),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_the_recommended_setting_of_a_hugging_face_model_measures_its_plan(name):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(HF_CONFIGS[name])
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)

    def model_fn():
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def batch_fn(n):
        return torch.randint(0, 512, (n, 64))

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss
    r = dist_optim.fit(model_fn, batch_fn, loss_fn, memory="64MiB", global_batch=4, lr=1e-3)
    s = r.best.setting
    torch.manual_seed(0)
    batches = [batch_fn(s.micro_batch) for _ in range(2 * s.accumulation_steps)]

    def run():  # the whole run: the model, its optimizer, two steps (the first creates the state)
        model = dist_optim._planner._fit_model.checkpoint_first(model_fn(), s.checkpoint_blocks)
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, accumulation_steps=s.accumulation_steps,
                                             lr=1e-3)
        for ids in batches:
            opt.backward(loss_fn(model, ids) / s.accumulation_steps)
    measured = allocator_peak(run)["peak_bytes"]
    planned = r.best.planned_peak_bytes
    assert abs(measured - planned) <= 0.1 * planned, (measured, planned)


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    lib, why = build_shim(str(tmp_path_factory.mktemp("shim")))
    if lib is None:
        pytest.skip(f"the per-rank peak needs benchmarks/heap_shim.c compiled and preloaded: {why}")
    return lib


def _launch(*args: str, nproc: int = 1, env: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    cmd = ([sys.executable] if nproc == 1 else [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc)])
    out = subprocess.run([*cmd, "-m", "launch.train", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == expect, f"{args}\nrc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _measured(run_dir: pathlib.Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["memory_peak_bytes"]  # the shim's peak since each rank began: the whole run's


def test_launch_fit_on_two_ranks_runs_what_it_chose_under_the_budget(tmp_path, shim, capsys):
    """One search (in this process: it plans on fake tensors, in forked workers), three of its candidates run under
    torchrun: the one it chose, at or under the budget; the cheapest one that only the headroom rejected (what a
    4.2 MiB budget chooses), within 10 % of its plan; and the largest one, over the budget."""
    from launch import train

    budget = 3.3
    assert train.main(["--fit", "--memory", f"{budget}MiB", "--nproc", "2", *SHAPE, "--json",
                       str(tmp_path / "fit.json")]) == 0
    found = json.loads((tmp_path / "fit.json").read_text())
    assert found["fits"] and found["budget_bytes"] == int(budget * MiB)
    assert "run: torchrun --nproc-per-node 2" in capsys.readouterr().out
    candidates, budget_bytes = found["candidates"], found["budget_bytes"]
    chosen = next(c for c in candidates if c["argv"] == found["argv"])
    headroom = [c for c in candidates if found["usable_bytes"] < c["planned_peak_bytes"] <= budget_bytes]
    over = [c for c in candidates if c["planned_peak_bytes"] > budget_bytes]
    assert over and not any(c["fits"] for c in over + headroom) and len(candidates) >= 10
    assert headroom  # the cheapest of them is what a 4.2 MiB budget chooses
    runs = {"chosen": chosen, "headroom": headroom[0], "over": over[-1]}
    for name, c in runs.items():
        _launch(*c["argv"], "--steps", "3", "--corpus-mb", "0.25", "--run-dir", str(tmp_path / name), nproc=2,
                env={"LD_PRELOAD": shim})
        for peak in _measured(tmp_path / name):
            assert abs(peak - c["planned_peak_bytes"]) <= 0.1 * c["planned_peak_bytes"], (name, c["argv"], peak)
            if name != "headroom":  # planned within the headroom of the budget: either side of it, measured
                assert (peak <= budget_bytes) == (name == "chosen"), (name, peak)


def test_a_budget_under_every_candidate_exits_3_naming_the_smallest(tmp_path, capsys):
    from launch import train

    assert train.main(["--fit", "--memory", "1MiB", *SHAPE, "--json", str(tmp_path / "f.json")]) == 3
    found = json.loads((tmp_path / "f.json").read_text())
    assert not found["fits"] and found["argv"] is None
    err = capsys.readouterr().err
    assert f"{found['smallest_budget_bytes'] / MiB:.1f} MiB" in err and "nothing fits --memory 1MiB" in err


def test_the_planners_command_line_exits_3_when_nothing_fits(tmp_path):
    args = [sys.executable, "-m", "dist_optim.plan", "--fit", "--memory", "1MiB", "--model", "launch.gpt:GPT",
            "--model-kwargs", '{"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}',
            "--quiet", "--json", str(tmp_path / "f.json")]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "nothing fits: the smallest candidate plans" in out.stdout
    assert not json.loads((tmp_path / "f.json").read_text())["fits"]


def test_launch_fit_names_the_layouts_the_job_cannot_take(capsys):
    from launch import train

    shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--nproc", "3"]
    assert train.main(["--fit", "--memory", "100MiB", "--batch-size", "3", *shape]) == 0  # one micro-batch size
    out = capsys.readouterr().out
    assert "skipped: --parallel tp: --n-embd 64 must be a multiple of the tensor-parallel size 3" in out
    assert "run: torchrun --nproc-per-node 3 -m launch.train --parallel " in out
    assert train.main(["--fit", "--memory", "100MiB", "--batch-size", "16", *shape]) == 2
    err = capsys.readouterr().err
    assert err.startswith("launch.train: error: --fit: no layout of 3 processes runs this job: --parallel ddp: "
                          "--batch-size 16 must be a multiple") and len(err.splitlines()) == 1

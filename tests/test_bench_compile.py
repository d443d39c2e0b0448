"""``python -m benchmarks.bench_compile --quick``: compiled per block, the in-backward saving stays; compiled whole,
it is gone and the optimizer says so; every mode ends bitwise where the standard loop compiled the same way ends
(aot_eager keeps eager kernels). Speed is never asserted here."""

from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_compile_quick_measures_the_saving_per_compile_mode(tmp_path):
    result, _ = run_benchmark_quick("bench_compile", tmp_path)
    assert result["command"].startswith("python -m benchmarks.bench_compile --quick")
    assert result["config"]["backend"] == "aot_eager"
    variants, saving = result["variants"], result["saving"]
    for mode in ("eager", "per_block", "whole"):
        ib = variants[f"inbackward_{mode}"]
        assert ib["reference"] == f"standard_{mode}" and ib["moved_from_init"] and ib["grads_left"] == 0
        assert ib["agreement"]["params_bitwise_equal"] and ib["agreement"]["state_bitwise_equal"], mode
        assert result["ratios"][f"inbackward_{mode}/standard_{mode}"]["paired_median"] > 0
    grads = result["grad_bytes"]
    for mode in ("eager", "per_block"):
        assert saving[mode]["achieved_bytes"] > 0 and saving[mode]["grad_bytes_peak"] < grads, (mode, saving[mode])
    assert saving["whole"]["achieved_bytes"] <= 0 and saving["whole"]["grad_bytes_peak"] == grads
    assert result["lost_saving_warnings"] == 1  # the whole-model optimizer's, once

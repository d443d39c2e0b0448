"""The benchmark scripts run (smoke mode) and what they measure is sane; speed is never asserted here."""

from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_core_quick_runs_and_in_backward_matches_and_saves_memory(tmp_path):
    result, _ = run_benchmark_quick("bench_core.py", tmp_path)
    assert set(result["models"]) == {"many_small", "few_large"}
    for name, model in result["models"].items():
        for variant in ("inbackward", "inbackward_per_param"):
            agreement = model["agreement"][variant]
            assert agreement["bitwise_equal_to_standard_fused"], (name, variant)
            assert agreement["moved_from_init"] and agreement["grads_left"] == 0
            assert model["memory"][variant]["peak_bytes"] < model["memory"]["standard_fused"]["peak_bytes"]

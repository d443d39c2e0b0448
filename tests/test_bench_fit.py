from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_fit_quick_times_a_search_and_reports_its_figures(tmp_path):
    result, _ = run_benchmark_quick("bench_fit", tmp_path)
    assert result["candidates"] == sum(result["by"].values()) >= 10
    assert result["traced"] >= 1 and result["wall_seconds"] >= result["search_seconds"] > 0
    assert result["peak_rss_bytes"] > 2**20 and result["fits"] and "--parallel" in result["best_argv"]

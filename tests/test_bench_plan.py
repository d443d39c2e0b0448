"""The planner's benchmark runs (smoke mode), and its planned peaks are the measured ones."""

from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_plan_quick_runs_and_plans_what_it_measures(tmp_path):
    result, _ = run_benchmark_quick("bench_plan", tmp_path)
    assert result["mode"] == "quick" and result["command"].startswith("python -m benchmarks.bench_plan")
    assert set(result["rows"]) == {"gpt_64x2/none", "gpt_64x2/exact", "gpt_64x2/two_pass"}
    for name, row in result["rows"].items():
        for loop in ("standard", "in_backward"):
            assert abs(row[loop]["error"]) <= 0.10 and abs(row[loop]["step_error"]) <= 0.10, (name, loop, row)
            assert sum(row[loop]["breakdown"].values()) == row[loop]["planned_peak"], (name, loop)

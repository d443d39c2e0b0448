"""The benchmark scripts run (smoke mode) and what they measure is sane; speed is never asserted here."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_core_quick_runs_and_in_backward_matches_and_saves_memory(tmp_path):
    out = tmp_path / "bench_core.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_core.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"many_small", "few_large"}
    for name, model in result["models"].items():
        for variant in ("inbackward", "inbackward_per_param"):
            agreement = model["agreement"][variant]
            assert agreement["bitwise_equal_to_standard_fused"], (name, variant)
            assert agreement["moved_from_init"] and agreement["grads_left"] == 0
            assert model["memory"][variant]["peak_bytes"] < model["memory"]["standard_fused"]["peak_bytes"]

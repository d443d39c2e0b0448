"""``python -m benchmarks.bench_pipeline --quick`` runs two pipeline stages on 2 gloo ranks, each in-backward variant
ends bitwise where the standard loop on the same schedule ends, and the results file holds real figures per stage
(peaks, paired time ratios, gradient bytes); speed is never asserted here."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import run_benchmark_quick

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

COUNTERPARTS = {"gpipe_inb": "gpipe_std", "1f1b_inb": "1f1b_std"}


@pytest.mark.parametrize("dp", [1, 2])
def test_bench_pipeline_quick_in_backward_equals_the_standard_loop_per_stage(tmp_path, dp):
    # dp 2: each of the 2 stages fully_shard-ed over 2 ranks (pipeline x FSDP2, 4 ranks)
    result, stderr = run_benchmark_quick("bench_pipeline", tmp_path, "--dp", str(dp))
    assert "profiler_start" not in stderr
    assert result["mode"] == "quick" and result["config"]["world"] == 2 * dp
    reps = result["config"]["repeats"]
    ranks = result["per_rank"]
    assert [r["rank"] for r in ranks] == list(range(2 * dp))
    for r in ranks:
        variants = r["variants"]
        assert set(variants) == set(COUNTERPARTS) | set(COUNTERPARTS.values())
        for name, v in variants.items():
            assert len(v["timing"]["samples_s"]) == reps, name
            assert v["moved_from_init"] and v["grads_left"] == 0, name
            assert v["memory"]["allocator"]["events"] > 0 and v["memory"]["peak_bytes"] > 0, name
        for name, std in COUNTERPARTS.items():
            assert variants[name]["reference"] == std
            agreement = variants[name]["agreement"]
            assert agreement["params_bitwise_equal"] and agreement["state_bitwise_equal"], (r["rank"], name)
            assert agreement["max_abs_diff"] == 0.0
            # several buckets per stage (quick's cap is small), together holding every gradient byte once
            assert len(r["bucket_bytes"][name]) > 1 and sum(r["bucket_bytes"][name]) == r["grad_bytes"]
    for key, s in result["summary"].items():
        assert s["params_bitwise_equal"] and s["state_bitwise_equal"], key
        assert len(s["time_ratio_paired"]) == 2 * dp and all(x > 0 for x in s["time_ratio_paired"]), key
        assert all(a > 0 and b > 0 for a, b in s["peak_bytes"]), key
        assert all(0 < h < g for h, g in zip(s["hoped_saving_bytes"], s["grad_bytes"])), key

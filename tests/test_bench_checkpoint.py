"""``python -m benchmarks.bench_checkpoint --quick`` runs (2 gloo ranks, FSDP2): both sides' loads give back the saved state
bitwise, and what it measures is sane; speed is never asserted here."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import run_benchmark_quick

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

SIDES = ("ours", "dcp")


def test_bench_checkpoint_quick_round_trips_and_measures_sane_figures(tmp_path):
    result, _ = run_benchmark_quick("bench_checkpoint", tmp_path)
    assert result["mode"] == "quick" and result["config"]["world"] == 2
    reps = result["config"]["repeats"]
    ranks = result["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]

    for r in ranks:
        for side in SIDES:
            assert r["roundtrip_mismatches"][side] == [], (r["rank"], side)
            assert r["async_complete"][side], (r["rank"], side)
            for t in (r["times"][k][side] for k in ("save", "load", "staged", "done")):
                assert len(t["samples_s"]) == reps and all(s > 0 for s in t["samples_s"]), (r["rank"], side)
                assert t["p25_s"] <= t["median_s"] <= t["p75_s"]
            staged, done = r["times"]["staged"][side]["samples_s"], r["times"]["done"][side]["samples_s"]
            assert all(a <= b for a, b in zip(staged, done)), (r["rank"], side)
            b = r["bytes"][side]
            assert b["rank_files"] >= 1 and b["rank_bytes"] > 0, (r["rank"], side)
            assert b["shared_bytes"][".metadata"] > 0
        # each rank holds its shards of parameters and of AdamW's two moments: its files hold at least those
        held = r["param_bytes_local"] + r["optim_state_bytes_local"]
        assert r["optim_state_bytes_local"] >= 2 * r["param_bytes_local"] > 0
        assert min(r["bytes"][s]["rank_bytes"] for s in SIDES) >= held
        assert {"dist_optim.json", "COMMITTED"} <= set(r["bytes"]["ours"]["shared_bytes"])
        assert 0.5 < r["bytes"]["ours"]["rank_bytes"] / r["bytes"]["dcp"]["rank_bytes"] < 2
        for key in ("save", "load", "staged", "done"):
            q = r["ratios"][key]
            assert q["of_medians"] > 0 and q["paired_p25"] <= q["paired_median"] <= q["paired_p75"], key
    assert 0.5 < result["total_bytes"]["ours"] / result["total_bytes"]["dcp"] < 2

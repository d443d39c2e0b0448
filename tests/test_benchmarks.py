"""``python -m benchmarks.bench_core --quick`` runs (all four models), its in-backward variants end bitwise where the
fused standard loop ends, peak lower, and its results file holds real figures; speed is never asserted here."""

from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_core_quick_matches_the_fused_standard_loop_and_saves_memory(tmp_path):
    result, _ = run_benchmark_quick("bench_core", tmp_path)
    assert result["mode"] == "quick" and result["command"].startswith("python -m benchmarks.bench_core --quick")
    assert result["machine"]["torch"] and result["machine"]["cpu_count"] >= 1
    assert set(result["models"]) == {"many_small", "few_large", "stack500", "stack2000"}
    reps = result["config"]["repeats"]
    for name in ("stack500", "stack2000"):
        _check_stack(result["models"][name], reps, name)
    for name, model in result["models"].items():
        if name.startswith("stack"):
            continue
        variants = model["variants"]
        std = variants["standard_fused"]
        for v in variants.values():
            assert len(v["timing"]["samples_s"]) == reps and v["timing"]["median_s"] > 0, name
            assert v["moved_from_init"] and v["grads_left"] == 0, name
            assert v["memory"]["allocator"]["events"] > 0 and v["memory"]["peak_bytes"] > 0, name
        for variant in ("inbackward", "inbackward_per_param", "torch_private_fused"):
            agreement = variants[variant]["agreement"]
            assert variants[variant]["reference"] == "standard_fused"
            assert agreement["params_bitwise_equal"], (name, variant)
            if variant != "torch_private_fused":  # torch's private function keeps no optimizer we can read
                assert agreement["state_bitwise_equal"], (name, variant)
            assert agreement["max_abs_diff"] == 0.0
            assert variants[variant]["memory"]["peak_bytes"] < std["memory"]["peak_bytes"], (name, variant)
        assert set(model["ratios"]) >= {"inbackward/standard_fused", "inbackward/torch_private_default"}
        for r in model["ratios"].values():
            assert r["of_medians"] > 0 and r["paired_p25"] <= r["paired_median"] <= r["paired_p75"], name
        # the buckets come from opt.buckets: together they hold every gradient byte once
        assert sum(model["buckets_bytes"]) == model["grad_bytes"] and len(model["buckets_bytes"]) > 1, name
        s = model["saving"]["inbackward"]
        assert s["theoretical_bytes"] == model["grad_bytes"] - max(model["buckets_bytes"])
        assert s["achieved_bytes"] == std["memory"]["peak_bytes"] - variants["inbackward"]["memory"]["peak_bytes"]
        assert 0 < s["fraction"] <= 1.05, (name, s)


def _check_stack(model, reps, name):
    """A hook-bound stack: in backward and the standard loop with no-op hooks both end bitwise where the fused
    standard loop ends; the per-tensor figures are the paired differences over the tensor count."""
    variants = model["variants"]
    assert set(variants) == {"standard_fused", "inbackward", "standard_fused_noop_hooks"}, name
    assert model["n_tensors"] == 40 and sum(model["buckets_bytes"]) == model["grad_bytes"], name
    for v in variants.values():
        assert len(v["timing"]["samples_s"]) == reps and v["moved_from_init"] and v["grads_left"] == 0, name
    for variant in ("inbackward", "standard_fused_noop_hooks"):
        agreement = variants[variant]["agreement"]
        assert agreement["params_bitwise_equal"] and agreement["state_bitwise_equal"], (name, variant)
    std = variants["standard_fused"]["timing"]["samples_s"]
    for key, variant in (("inbackward_added_us", "inbackward"), ("noop_hook_us", "standard_fused_noop_hooks")):
        samples = variants[variant]["timing"]["samples_s"]
        diffs = sorted((a - b) / model["n_tensors"] * 1e6 for a, b in zip(samples, std))
        t = model["per_tensor"][key]
        assert t["median_us"] == diffs[len(diffs) // 2] and t["p25_us"] <= t["median_us"] <= t["p75_us"], (name, key)

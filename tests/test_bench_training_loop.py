"""The training-loop benchmark runs (smoke mode) and what it measures is sane; speed is never asserted here."""

from __future__ import annotations

from helpers import run_benchmark_quick

# in-backward variant -> the standard loop it must equal bitwise (parameters and optimizer state)
COUNTERPARTS = {
    "clipping": {
        "inb": "std",
        "inb_track_norm": "std",
        "inb_clip_exact": "std_clip",
        "inb_clip_previous_norm": "std_clip_previous_norm",
        "inb_clip_per_parameter": "std_clip_per_tensor",
    },
    "accumulation": {"inb_accum": "std_accum"},
    "grad_scaler": {"inb_scaler_exact": "std_scaler", "inb_scaler_per_bucket": "std_scaler"},
}


def test_bench_training_loop_quick_runs_matches_the_standard_loops_and_saves_memory(tmp_path):
    result, _ = run_benchmark_quick("bench_training_loop", tmp_path)
    assert result["mode"] == "quick"
    assert set(result["models"]) == {"many_small"}
    assert result["command"].startswith("python -m benchmarks.bench_training_loop")
    reps = result["config"]["repeats"]
    sections = result["models"]["many_small"]["sections"]
    assert set(sections) == set(COUNTERPARTS)

    for key, pairs in COUNTERPARTS.items():
        variants = sections[key]["variants"]
        for name, v in variants.items():
            assert len(v["timing"]["samples_s"]) == reps, (key, name)  # every variant timed in every repetition
            assert v["moved_from_init"] and v["grads_left"] == 0, (key, name)
            assert v["memory"]["allocator"]["events"] > 0 and v["memory"]["peak_bytes"] > 0, (key, name)
        for name, ref in pairs.items():
            v = variants[name]
            assert v["reference"] == ref, (key, name)
            agreement = v["agreement"]
            assert agreement["params_bitwise_equal"] and agreement["state_bitwise_equal"], (key, name, agreement)
            assert agreement["max_abs_diff"] == 0.0
        for pair, r in sections[key]["ratios"].items():
            assert set(pair.split("/")) <= set(variants), pair
            assert r["of_medians"] > 0 and r["paired_p25"] <= r["paired_median"] <= r["paired_p75"], pair
        assert {f"{n}/{ref}" for n, ref in pairs.items()} <= set(sections[key]["ratios"])

    def peak(key: str, name: str) -> int:
        return sections[key]["variants"][name]["memory"]["peak_bytes"]

    clipping = sections["clipping"]["variants"]
    # Clipping that keeps the memory saving has a lower peak than the standard loop with clip_grad_norm_; exact
    # clipping holds every gradient, as that loop does.
    for name in ("inb_clip_previous_norm", "inb_clip_per_parameter"):
        assert peak("clipping", name) < peak("clipping", "std_clip"), name
        assert clipping[name]["saving"]["achieved_bytes"] > 0 and clipping[name]["saving"]["theoretical_bytes"] > 0
    assert peak("clipping", "inb") < peak("clipping", "std")
    assert peak("clipping", "inb_track_norm") < peak("clipping", "std")
    assert peak("clipping", "inb_clip_exact") >= peak("clipping", "inb")
    # The norms measured in backward are the ones the standard counterpart measured on the same trajectory.
    for name, ref in (("inb_clip_exact", "std_clip"), ("inb_clip_previous_norm", "std_clip_previous_norm")):
        norm = clipping[ref]["info"]["grad_norm"]
        assert norm is not None and norm > 0 and clipping[name]["info"]["grad_norm"] == norm, name
    assert clipping["inb_clip_exact"]["info"]["clip_coef"] < 1  # quick mode's max_norm makes the clipping active
    assert clipping["inb_track_norm"]["info"]["grad_norm"] > 0
    assert clipping["inb"]["info"]["grad_norm"] is None

    # Accumulation: k micro-batches per unit, and the step fired on the last one.
    acc = sections["accumulation"]
    k = result["config"]["accumulation"]
    for name in ("std_accum", "inb_accum"):
        assert len(acc["variants"][name]["memory"]["allocator"]["per_step_peak_bytes"]) == k
    assert acc["variants"]["inb_accum"]["info"]["micro_batches_pending"] == 0
    assert acc["variants"]["inb_accum"]["info"]["params_stepped"] == result["models"]["many_small"]["n_tensors"]

    # GradScaler: same final scale; per-bucket overflow handling keeps the saving, exact holds the gradients.
    scaler = sections["grad_scaler"]["variants"]
    assert {v["info"]["scale"] for v in scaler.values()} == {scaler["std_scaler"]["info"]["scale"]}
    assert not any(scaler[n]["info"]["overflow"] for n in ("inb_scaler_exact", "inb_scaler_per_bucket"))
    assert peak("grad_scaler", "inb_scaler_per_bucket") < peak("grad_scaler", "std_scaler")

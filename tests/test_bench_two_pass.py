"""``python -m benchmarks.bench_two_pass --quick`` runs: its in-backward variants end bitwise where their standard
loops end (two_pass and exact where clip_grad_norm_ + step ends), two_pass keeps a memory saving that exact mode
gives up, and the phases and floor are in the results file; speed is never asserted here."""

from __future__ import annotations

from helpers import run_benchmark_quick


def test_bench_two_pass_quick_is_exact_and_keeps_the_saving(tmp_path):
    result, _ = run_benchmark_quick("bench_two_pass", tmp_path)
    assert result["mode"] == "quick" and set(result["models"]) == {"gpt_tiny", "gpt_tiny/ckpt"}
    for name, model in result["models"].items():
        variants = model["variants"]
        for variant, reference in (("inb", "std"), ("inb_exact", "std_clip"), ("inb_two_pass", "std_clip")):
            v = variants[variant]
            assert v["reference"] == reference and v["moved_from_init"] and v["grads_left"] == 0, (name, variant)
            agreement = v["agreement"]
            assert agreement["params_bitwise_equal"] and agreement["state_bitwise_equal"], (name, variant)
        t = model["two_pass"]
        saving = t["saving_bytes"]
        assert saving["plain_in_backward"] > 0 and saving["two_pass"] > 0 and saving["exact"] <= 0, (name, saving)
        assert set(t["phases_s"]) == {"forward", "backward", "step_and_clip"} and t["floor"] > 0, name
        assert t["activation_bytes"] > 0 and t["grad_bytes"] > 0, name
        assert model["ratios"]["inb_two_pass/std_clip"]["paired_median"] > 0, name

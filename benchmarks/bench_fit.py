"""How long ``launch.train --fit`` takes on an 8B-shaped job, and how much memory the search itself needs.

    python -m benchmarks.bench_fit            # the trainer's GPT at 8B shape (32 x 4096, 4096 tokens), 8 processes,
                                              # global batch 64, clipping: 66 candidates (a few minutes on 2 cores)
    python -m benchmarks.bench_fit --quick    # a tiny shape on 2 processes: seconds

The search runs as a user runs it (a subprocess, its own Python); measured: wall seconds, the search's own
figures (candidates, traces, seconds), and the subprocess's peak resident memory (``getrusage`` of the children).
The result names the best candidate's argv, or the smallest budget when nothing fits.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "8b": ["--n-layer", "32", "--n-embd", "4096", "--n-head", "32", "--block-size", "4096", "--batch-size", "64",
           "--nproc", "8", "--max-grad-norm", "1.0", "--memory", "80GiB"],
    "tiny": ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64", "--batch-size", "4",
             "--nproc", "2", "--memory", "8MiB"],
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny shape")
    p.add_argument("--out", default="bench_fit.json", help="the JSON result")
    args = p.parse_args(argv)
    shape = "tiny" if args.quick else "8b"
    with tempfile.TemporaryDirectory() as tmp:
        found = pathlib.Path(tmp) / "fit.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "launch.train", "--fit", *SHAPES[shape], "--json",
                               str(found)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 3):
            sys.exit(f"launch.train --fit failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        search = json.loads(found.read_text())
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    result = {"shape": shape, "argv": SHAPES[shape], "wall_seconds": round(wall, 1),
              "search_seconds": search["seconds"], "candidates": len(search["candidates"]),
              "traced": search["traces"], "peak_rss_bytes": rss, "fits": search["fits"],
              "best_argv": search["argv"], "best_planned_peak_bytes": search["planned_peak_bytes"],
              "smallest_budget_bytes": search["smallest_budget_bytes"],
              "by": {k: sum(c["planned_by"] == k for c in search["candidates"]) for k in ("traced", "derived", "bound")}}
    print(f"{shape}: {result['candidates']} candidates ({result['by']}), {result['traced']} traces, "
          f"{result['wall_seconds']} s wall, peak RSS {rss / 2**20:.0f} MiB; fits: {result['fits']}")
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

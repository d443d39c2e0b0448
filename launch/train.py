"""Train a small byte-level GPT on the Python stdlib's own sources, with the AdamW step inside the backward pass.

The launch manual (run from the repository root, after ``pip install -e '.[job]'``; every flag:
``python -m launch.train --help``):

One process (no process group; ``--parallel none``)::

    python -m launch.train --steps 50

One machine, two processes (FSDP2 by default: ``fully_shard`` on each block, then the root; gloo on CPU, NCCL
with one GPU per process when CUDA is present)::

    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50
    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50 --parallel ddp

Two machines (run the same command on both, HOST:PORT being the first machine's address and a free port;
``--rdzv-id`` names the job)::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id gpt \\
        -m launch.train --steps 50

To let torchrun restart the job after a failure (``--max-restarts N`` with ``--resume latest``), also set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every machine: with torch's default, restarted workers reuse the
previous round's store and fail to connect (pytorch/pytorch#135712; multinode_tests/ runs it this way).

Options that change the training loop:

- ``--optimizer-mode standard``: ``loss.backward(); opt.step(); opt.zero_grad()`` with fused ``torch.optim.AdamW``
  instead of ``dist_optim.InBackwardOptimizer``: the same losses, bitwise where the arithmetic is the same.
- ``--accumulation-steps K``: K micro-batches per step (``no_sync()`` under DDP, ``set_requires_gradient_sync``
  under FSDP2, ``accumulation_steps=K`` in one process). ``--batch-size`` is the global batch per step; it must
  divide by world size x K, and the batches are the same whatever the world size.
- ``--max-grad-norm C [--clip-mode exact|per_parameter|previous_norm]``: clipping (docs/clipping.md); ``exact``
  holds the step's gradients until backward ends and so gives up the memory saving.
- ``--checkpoint-every N`` and ``--resume latest`` (or a checkpoint path, or a step number): checkpoints go to
  RUN_DIR/checkpoints and resume on any number of processes; a resumed run gives the losses of an uninterrupted one.
- ``--compare``: train the job with both loops, step by step, and write RUN_DIR/compare/report.md, report.json and
  compare.png (loss curves, their max difference, step times, per-rank peak memory and one step's memory timeline).

Output: a progress line per step on rank 0, RUN_DIR/metrics.jsonl (one JSON object per step), TensorBoard events in
RUN_DIR/tensorboard when TensorBoard is installed.
"""

from __future__ import annotations

import json
import logging
import pathlib
import statistics
import sys

from dist_optim.checkpoint import CheckpointManager

from .compare import compare
from .corpus import Corpus
from .run_log import RunLog
from .runtime import LaunchError, resolve_parallel, start, stop
from .train_config import TrainConfig, parse_config
from .train_loop import Job

log = logging.getLogger("train")


def train(cfg: TrainConfig, rt, parallel: str, corpus: Corpus) -> None:
    job = Job(cfg, rt, corpus, parallel, cfg.optimizer_mode)
    checkpoints = CheckpointManager(pathlib.Path(cfg.run_dir) / "checkpoints", keep_last=cfg.keep_checkpoints)
    first = 0
    if cfg.resume is not None:
        which = int(cfg.resume) if cfg.resume.isdigit() else cfg.resume
        found = checkpoints.load(which, model=job.model, optimizer=job.opt, schedulers=[job.sched])
        if found is None:
            log.info("no checkpoint in %s: starting fresh", checkpoints.directory)
        else:
            first = found.step + 1
            if cfg.max_grad_norm is not None and cfg.clip_mode == "previous_norm":
                log.warning("clip_mode previous_norm: the previous step's norm is not in the checkpoint, so step %d "
                            "is not clipped (an uninterrupted run would clip it)", first)
            log.info("resumed from %s (step %d, saved by %d process(es))", found.path, found.step, found.world_size)
    last = cfg.steps - 1 if cfg.stop_after is None else min(cfg.steps - 1, cfg.stop_after)
    if rt.is_main:
        log.info("%s, %d process(es), %s, %s mode, %.2fM parameters, steps %d to %d of %d", cfg.run_dir,
                 rt.world, parallel, cfg.optimizer_mode, job.n_params / 1e6, first, last, cfg.steps)
    run_log = RunLog(cfg.run_dir, rt.is_main, cfg.log_every, resume_step=first - 1 if cfg.resume else None)
    done = []
    for step in range(first, last + 1):
        done.append(job.step(step))
        run_log.record(done[-1])
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step == last):
            checkpoints.save(step, model=job.model, optimizer=job.opt, schedulers=[job.sched],
                             extra={"parallel": parallel, "optimizer_mode": cfg.optimizer_mode})
    run_log.close()
    if done and rt.is_main:
        speed = statistics.median(r.tokens / r.seconds for r in done)
        log.info("done: steps %d to %d, loss %.4f -> %.4f, median %.0f tokens/s; metrics in %s", first, last,
                 done[0].loss, done[-1].loss, speed, run_log.path)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        rt = start(cfg.device, cfg.threads)
    except LaunchError as e:
        print(f"launch.train: error: {e}", file=sys.stderr)
        return 2
    if not rt.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        parallel = resolve_parallel(cfg.parallel, rt)
        if cfg.compare and (cfg.resume or cfg.checkpoint_every):
            raise LaunchError("--compare trains two jobs from scratch: drop --resume and --checkpoint-every")
        corpus = Corpus(cfg.corpus_mb, cfg.block_size, cfg.seed)
        if rt.is_main:
            pathlib.Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(cfg.run_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
        if cfg.compare:
            compare(cfg, rt, parallel, corpus)
        else:
            train(cfg, rt, parallel, corpus)
    except LaunchError as e:
        if rt.is_main:
            print(f"launch.train: error: {e}", file=sys.stderr)
        return 2
    finally:
        stop(rt)
    return 0


if __name__ == "__main__":
    sys.exit(main())

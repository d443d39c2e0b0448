"""Train a small byte-level GPT on the Python stdlib's own sources, with the optimizer step (AdamW by default)
inside the backward pass.

The launch manual (run from the repository root, after ``pip install -e '.[job]'``; every flag:
``python -m launch.train --help``):

One process (no process group; ``--parallel none``)::

    python -m launch.train --steps 50

One machine, two processes (FSDP2 by default: ``fully_shard`` on each block, then the root; gloo on CPU, NCCL
with one GPU per process when CUDA is present)::

    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50
    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50 --parallel ddp
    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50 --parallel pp --tie-weights false
    torchrun --standalone --nproc-per-node 4 -m launch.train --steps 50 --parallel pp+fsdp2 --pp-stages 2 \\
        --tie-weights false
    torchrun --standalone --nproc-per-node 2 -m launch.train --steps 50 --parallel tp
    torchrun --standalone --nproc-per-node 4 -m launch.train --steps 50 --parallel fsdp2+tp --tp-size 2

Two machines (run the same command on both, HOST:PORT being the first machine's address and a free port;
``--rdzv-id`` names the job)::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id gpt \\
        -m launch.train --steps 50

To let torchrun restart the job after a failure (``--max-restarts N`` with ``--resume latest``), also set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every machine: with torch's default, restarted workers reuse the
previous round's store and fail to connect (pytorch/pytorch#135712; multinode_tests/ runs it this way).

Options that change the training loop:

- ``--optimizer adamw|adamw8bit|adamw4bit|lion|muon``: the optimizer class, fused ``torch.optim.AdamW`` by default;
  torchao's ``AdamW8bit`` and ``AdamW4bit`` (8-bit and 4-bit states) and pytorch-optimizer's ``Lion`` need the
  ``optimizers`` extra (``pip install -e '.[optimizers]'``; without it, a one-line error). ``--lr``, ``--beta1``,
  ``--beta2`` and ``--weight-decay`` go to whichever class. ``muon``: ``torch.optim.Muon`` for the blocks' 2-D weight
  matrices (``--lr`` and ``--weight-decay`` with ``adjust_lr_fn="match_rms_adamw"``, its own momentum 0.95) and
  fused AdamW for the embeddings, head, norms and biases, a param group each, in both loops; one process only
  (``--parallel none``), not with ``--plan``. A resume keeps the checkpoint's ``--optimizer``; torchao's
  quantised states are checkpointed as their codes and scales and resume exactly (under FSDP2, on the same number of
  processes only).
- ``--optimizer-mode standard``: ``loss.backward(); opt.step(); opt.zero_grad()`` with the same class instead of
  ``dist_optim.InBackwardOptimizer``: the same losses, bitwise where the arithmetic is the same.
- ``--accumulation-steps K``: K micro-batches per step (``no_sync()`` under DDP, ``set_requires_gradient_sync``
  under FSDP2, ``accumulation_steps=K`` in one process). ``--batch-size`` is the global batch per step; it must
  divide by world size x K, and the batches are the same whatever the world size.
- ``--parallel pp [--pp-stages S] [--microbatches M] [--pp-schedule 1f1b|gpipe]``: pipeline stages cut on block
  boundaries, one per process, each stepped in its last micro-batch backward (``dist_optim.pipeline_optimizers``);
  every stage sees the whole batch, split into M micro-batches. Needs ``--tie-weights false`` (embedding and head
  on different ranks) and ``--clip-mode per_parameter`` when clipping; checkpoints go to
  RUN_DIR/checkpoints/stage{r} and resume on the same split, from the newest step every stage saved.
  ``--parallel pp+fsdp2 --pp-stages S``: the same stages, each ``fully_shard``-ed over world / S processes (at least
  2; ranks ``[0, world / S)`` hold stage 0); each of the world / S pipelines takes its part of the global batch, as
  under ``--parallel fsdp2``, and the loss logged is their mean. Same refusals; checkpoints/stage{s} is saved by
  every rank of the stage.
- ``--parallel tp``: tensor parallel over every process (``parallelize_module``): each block's MLP
  ``ColwiseParallel`` then ``RowwiseParallel``, every other parameter a replicated DTensor (the fused ``qkv``
  Linear's rows are q, k, v in turn, so one column split would not give a rank its heads); every rank sees the
  whole batch. ``--parallel fsdp2+tp --tp-size T``: a ``("dp", "tp")`` mesh of world / T x T (ranks
  ``[d * T, (d + 1) * T)`` are replica d), TP first, then ``fully_shard`` per block and the root on "dp"; each
  replica takes its part of the global batch, as ``--parallel fsdp2``'s ranks do. ``--n-embd`` must divide by the
  TP size; ``--tp-size`` with any other ``--parallel`` (pipelines included) is refused. Checkpoints resume on
  another layout (the parameters keep the plain model's names and full shapes): fsdp2+tp's on one process, say.
- ``--max-grad-norm C [--clip-mode exact|two_pass|per_parameter|previous_norm]``: clipping (docs/clipping.md);
  ``exact`` holds the step's gradients until backward ends and so gives up the memory saving; ``two_pass`` gives
  the same result and keeps the saving, for the time of a second backward.
- ``--checkpoint-every N`` and ``--resume latest`` (or a checkpoint path, or a step number): checkpoints go to
  RUN_DIR/checkpoints and resume on any number of processes; a resumed run gives the losses of an uninterrupted one.
  A resume takes the run's options from RUN_DIR/config.json (all but those of the launch: ``--parallel``,
  ``--threads``, ``--stop-after`` ...), keeps the model's shape (changing ``--n-embd`` etc. is refused) and applies
  every other option given (``--lr``, the schedule, clipping, batches), logging what changed. A fresh run into a
  directory that holds checkpoints is refused, as is a resume from a checkpoint older than the directory's latest:
  ``--overwrite`` deletes the checkpoints such a run would write over. ``--resume latest`` where no checkpoint was
  saved yet starts the run again (a restart before the first checkpoint); a run that finished without one, or
  other options, which would replace that run's metrics, are refused.
- SIGTERM (what a scheduler sends before it kills a job): every rank stops after the same step, saves a checkpoint
  and exits with code 0; ``--resume latest`` continues exactly.
- ``--plan``: plan the job's memory instead of running it: both loops' peaks per rank, their split and the saving,
  from one warm step on fake tensors (``dist_optim.plan``) for one representative rank of the layout the flags
  describe (``--parallel`` none, ddp, fsdp2, tp, fsdp2+tp or pp, with ``--tp-size``, ``--pp-stages``,
  ``--microbatches``, ``--pp-schedule``), on the micro-batch the run would give each rank; it prints the layout, the
  world size and the table, and writes RUN_DIR/plan.json and plan.png. The world size is torchrun's (rank 0 plans,
  the others exit at once; no process group is made) or, without torchrun, ``--nproc N``: an 8-process job planned
  on a laptop, ``python -m launch.train --plan --nproc 8 --parallel ddp``. Not planned, a one-line error:
  ``--parallel pp+fsdp2``, ``--accumulation-steps`` above 1 with tp or fsdp2+tp, ``--optimizer muon``.
- ``--compare``: train the job with both loops, step by step, and write RUN_DIR/compare/report.md, report.json and
  compare.png (loss curves, their max difference, step times, per-rank peak memory and one step's memory timeline,
  and bytes per parameter of both loops: parameters and optimizer states counted from their tensors, then with the
  profiled step's peak above them).

Output: a progress line per step on rank 0, RUN_DIR/metrics.jsonl (one JSON object per step: step, loss, lr,
grad_norm, tokens/s, and per rank in rank order grad_bytes_peak, the gradient bytes alive at once in the step, and
memory_peak_bytes, the CUDA allocator's peak in the step or on CPU the process's resident high-water mark so far),
with --tensorboard TensorBoard events in RUN_DIR/tensorboard, with --wandb PROJECT a Weights & Biases run (each
needs its extra: a missing one is a one-line error naming it), RUN_DIR/config.json (the options in effect).
Ctrl-C stops as SIGTERM does: after the step, with a checkpoint (a second Ctrl-C aborts at once). Exit codes: 0 done
(or stopped by SIGTERM or Ctrl-C), 2 a refused flag or setting (a one-line error), 1 a loss that turned NaN or
infinite.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import pathlib
import statistics
import sys

# torch, DTensor and DCP make ~300k objects as they import, and every full collection on the way walks all made so
# far: 0.5 s of each process's start (a rank's), for nothing. Collected as usual from here on, the modules' objects
# frozen (once a process, before any run: nothing of a run's is frozen), so a run's full collections skip them.
_COLLECTING = gc.isenabled()
gc.disable()

from dist_optim.checkpoint import CheckpointError, CheckpointManager

from .compare import compare
from .corpus import Corpus
from .fit import fit_job
from .memory_plan import plan_memory
from .optimizers import optimizer_class
from .pipeline import PIPELINED, check_pipeline, stage_group, stage_of
from .run_dir import plan_run, write_config
from .run_log import RunLog, check_reporters
from .runtime import LaunchError, Runtime, TermSignal, start, stop
from .tensor_parallel import check_tp
from .train_config import TrainConfig, parse_config
from .train_loop import Job
from .wrapping import resolve_parallel

gc.freeze()
if _COLLECTING:
    gc.enable()

log = logging.getLogger("train")


class Diverged(RuntimeError):
    """The loss turned non-finite: training on would only spread NaNs into the next checkpoint."""


def train(cfg: TrainConfig, rt: Runtime, parallel: str, corpus: Corpus) -> None:
    """Train (or resume) the run in ``cfg.run_dir``; stops after the step all ranks agree on when SIGTERM arrives,
    with a checkpoint. Collective."""
    directory = pathlib.Path(cfg.run_dir) / "checkpoints"
    pipelined = parallel in PIPELINED
    if pipelined:
        # each stage saves and loads its own part, over its own ranks: checkpoints/stage{s}/step_N; pruned below only
        # once every stage has committed the step, so a kill between the stages' saves loses nothing
        stages = check_pipeline(cfg, rt, parallel)
        stage, replica = stage_of(rt, stages)
        checkpoints = CheckpointManager(directory / f"stage{stage}", process_group=stage_group(rt, stages))
    else:
        checkpoints = CheckpointManager(directory, keep_last=cfg.keep_checkpoints)
    # before anything in the run dir is written
    plan = plan_run(cfg, rt, checkpoints, stage_ranks=rt.world // stages if pipelined else 0)
    job = Job(cfg, rt, corpus, parallel, cfg.optimizer_mode)
    first = 0
    if cfg.resume is not None and plan.resume_from is None:
        log.info("no checkpoint in %s: starting fresh", checkpoints.directory)
    elif plan.resume_from is not None:
        try:
            found = checkpoints.load(plan.resume_from, model=job.model, optimizer=job.opt, schedulers=[job.sched])
        except CheckpointError as e:
            raise LaunchError(f"cannot resume from {plan.resume_from}: {e}") from e
        job.apply_options()
        job.load_extra_state(found.extra)
        first = found.step + 1
        log.info("resumed from %s (step %d, saved by %d process(es))", found.path, found.step, found.world_size)
        if plan.changed and rt.is_main:
            log.info("options changed since the checkpoint, in effect from step %d: %s", first,
                     ", ".join(plan.changed))
    if rt.is_main:
        write_config(cfg)
    last = cfg.steps - 1 if cfg.stop_after is None else min(cfg.steps - 1, cfg.stop_after)
    if first > last:
        if rt.is_main:
            log.info("done: the run in %s is finished (its checkpoint is of step %d, the last of --steps %d); to "
                     "train on, resume with a larger --steps", cfg.run_dir, first - 1, cfg.steps)
        return
    if rt.is_main:
        log.info("%s, %d process(es), %s, %s mode, %.2fM parameters, steps %d to %d of %d", cfg.run_dir,
                 rt.world, parallel, cfg.optimizer_mode, job.n_params / 1e6, first, last, cfg.steps)
    run_log = RunLog(cfg.run_dir, rt.is_main, cfg.log_every, resume_step=first - 1 if cfg.resume else None,
                     last_step=last, tensorboard=cfg.tensorboard, wandb=cfg.wandb, config=cfg.to_dict())
    done = []
    try:
        with TermSignal(announce=rt.is_main) as term:
            for step in range(first, last + 1):
                done.append(job.step(step))
                run_log.record(done[-1])
                if not math.isfinite(done[-1].loss):  # the same mean loss on every rank: all stop here
                    raise Diverged(
                        f"the loss is {done[-1].loss} at step {step} (lr {done[-1].lr:.3g}): the run diverged; lower "
                        f"--lr or clip with --max-grad-norm (the last checkpoint, if any, is from before)")
                stopping = step < last and term.agreed(rt)
                at_stop = step == last and cfg.stop_after is not None  # --stop-after: resumable without --checkpoint-every
                if stopping or at_stop or (cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0
                                                                       or step == last)):
                    try:
                        checkpoints.save(step, model=job.model, optimizer=job.opt, schedulers=[job.sched],
                                         extra={"parallel": parallel, "optimizer_mode": cfg.optimizer_mode,
                                                **job.extra_state()})
                    except NotImplementedError as e:  # states dist_optim.checkpoint cannot save (a subclass it cannot flatten)
                        raise LaunchError(f"--optimizer {cfg.optimizer}: cannot checkpoint its states: "
                                          f"{' '.join(str(e).split())}") from e
                    if rt.is_main:
                        log.info("checkpoint: step %d saved in %s", step, checkpoints.directory)
                    if pipelined:
                        rt.all_gather(step)  # every stage has committed this step
                        if replica == 0:  # one rank per stage's folder
                            checkpoints.prune(cfg.keep_checkpoints)
                if stopping:
                    if rt.is_main:
                        log.warning("%s: stopped after step %d with a checkpoint; continue with --resume latest",
                                    term.received or "SIGTERM", step)
                    break
    finally:
        run_log.close()
    if done and rt.is_main:
        speed = statistics.median(r.tokens / r.seconds for r in done)
        log.info("done: steps %d to %d, loss %.4f -> %.4f, median %.0f tokens/s; metrics in %s", first,
                 done[-1].step, done[0].loss, done[-1].loss, speed, run_log.path)


def _check_compare_dir(run_dir: pathlib.Path) -> None:
    """--compare writes RUN_DIR/config.json and RUN_DIR/compare: refused over a training run's directory (its
    metrics or checkpoints would no longer match its config); an earlier comparison is replaced."""
    held = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
    if held:
        raise LaunchError(f"--compare: {run_dir} holds a training run ({', '.join(held)}), whose config.json it would "
                          "overwrite; compare in another --run-dir")


def _error(rt: Runtime | None, message: str) -> None:
    if rt is None or rt.is_main:
        print(f"launch.train: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done (or stopped by SIGTERM with a checkpoint), 2 a refused setting (one line), 1 a diverged
    run."""
    cfg = parse_config(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if cfg.plan or cfg.fit or cfg.nproc is not None:  # no process group, no corpus: fake tensors of the job's shapes
        if int(os.environ.get("RANK", "0")):
            return 0  # under torchrun: rank 0 plans the job (or refuses it); the others have nothing to do
        try:
            if cfg.fit:
                return fit_job(cfg)
            if not cfg.plan:
                raise LaunchError(f"--nproc {cfg.nproc} sizes the job --plan plans; to run on {cfg.nproc} "
                                  f"processes, launch with torchrun --nproc-per-node {cfg.nproc}")
            plan_memory(cfg)
        except LaunchError as e:
            _error(None, str(e))
            return 2
        return 0
    try:
        rt = start(cfg.device, cfg.threads)
    except LaunchError as e:
        _error(None, str(e))
        return 2
    if not rt.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    failed = False
    try:
        parallel = resolve_parallel(cfg.parallel, rt)
        optimizer_class(cfg.optimizer)  # its package importable
        check_reporters(cfg.tensorboard, cfg.wandb)
        check_pipeline(cfg, rt, parallel)
        check_tp(cfg, rt, parallel)
        if cfg.compare and (cfg.resume or cfg.checkpoint_every or cfg.overwrite):
            raise LaunchError("--compare trains two jobs from scratch: drop --resume, --checkpoint-every and "
                              "--overwrite")
        if cfg.compare:
            _check_compare_dir(pathlib.Path(cfg.run_dir))
        corpus = Corpus(cfg.corpus_mb, cfg.block_size, cfg.seed)
        if cfg.compare:
            if rt.is_main:
                write_config(cfg)
            compare(cfg, rt, parallel, corpus)
        else:
            train(cfg, rt, parallel, corpus)
    except LaunchError as e:
        _error(rt, str(e))
        return 2
    except Diverged as e:
        _error(rt, str(e))
        return 1
    except BaseException:  # a bug, on this rank alone perhaps: its traceback now, not after the group's timeout
        failed = True
        raise
    finally:
        stop(rt, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a run may do with its run directory before it trains: resume which checkpoint, refuse to start fresh over
another run's checkpoints, delete what ``--overwrite`` allows, and which changed options a resume applies or refuses.

Rank 0 decides from the files and every rank receives the decision, so that all raise the same error or none does;
nothing is deleted or rewritten before the decision (``metrics.jsonl`` and ``config.json`` included).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from dist_optim.checkpoint import CheckpointManager

from .runtime import LaunchError, Runtime
from .train_config import MODEL_SHAPE, PROCESS_OPTIONS, TrainConfig

__all__ = ["Plan", "plan_run", "write_config"]

log = logging.getLogger("train")
_STAGE = re.compile(r"stage\d+")
_STEP = re.compile(r"step_\d+")


@dataclass
class Plan:
    resume_from: pathlib.Path | None  # the checkpoint to load; None: a fresh start
    changed: list[str] = field(default_factory=list)  # "name old -> new" of the options a resume applies


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _step_list(found: list[pathlib.Path]) -> str:
    return ", ".join(str(int(p.name.split("_")[1])) for p in sorted(found)) or "none"


def _target(cfg: TrainConfig, manager: CheckpointManager) -> pathlib.Path | None:
    """The checkpoint ``--resume`` names (None: ``latest`` in a directory without one), or a LaunchError."""
    found = manager.checkpoints()
    if cfg.resume == "latest":
        return found[0] if found else None
    path = manager.path_for(int(cfg.resume)) if cfg.resume.isdigit() else pathlib.Path(cfg.resume)
    if not (path / "COMMITTED").is_file():
        raise LaunchError(f"--resume {cfg.resume}: no committed checkpoint at {path} (the checkpoints of "
                          f"{manager.directory}: steps {_step_list(found)}); use --resume latest or one of them")
    return path


def _changes(cfg: TrainConfig, path: pathlib.Path) -> list[str]:
    """The options that differ from those of the run that wrote ``path`` (its run directory's config.json, when the
    checkpoint is one of a run directory's); a LaunchError when one of them shapes the model."""
    folder = path.resolve().parent
    if _STAGE.fullmatch(folder.name):  # a pipeline stage's: RUN_DIR/checkpoints/stage{r}/step_N
        folder = folder.parent
    recorded = folder.parent / "config.json"
    if folder.name != "checkpoints" or not recorded.is_file():
        return []  # a checkpoint from elsewhere: the load itself checks the names and shapes
    old: dict[str, Any] = json.loads(recorded.read_text())
    new = cfg.to_dict()
    shape = [f"{_flag(k)} {old[k]} (now {new[k]})" for k in MODEL_SHAPE if k in old and old[k] != new[k]]
    if shape:
        raise LaunchError(f"the checkpoint's model has {', '.join(shape)}: a resume keeps the model's shape; drop "
                          "those options, or start a fresh run in another --run-dir")
    was = old.get("optimizer", "adamw")  # runs from before --optimizer trained with AdamW
    if was != new["optimizer"]:
        raise LaunchError(f"the checkpoint's optimizer states are --optimizer {was}'s (now {new['optimizer']}): a "
                          "resume keeps the optimizer; drop --optimizer, or start a fresh run in another --run-dir")
    return [f"{_flag(k)} {old[k]} -> {new[k]}" for k in _differing(old, new)]


def _differing(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The options of the training (not of one process run) whose values differ between two configs."""
    return [k for k in new if k not in PROCESS_OPTIONS and k in old and old[k] != new[k]]


def _refuse_another_runs_fresh_start(cfg: TrainConfig, manager: CheckpointManager) -> None:
    """``--resume latest`` with no checkpoint starts fresh: a restart (torchrun ``--max-restarts``) before the first
    checkpoint, with the run's own options. A run that finished without a checkpoint has nothing to resume, and other
    options would make another job: either would replace the run's metrics.jsonl and config.json, and is refused."""
    run_dir = pathlib.Path(cfg.run_dir)
    if cfg.overwrite or not (run_dir / "config.json").is_file():
        return
    old: dict[str, Any] = json.loads((run_dir / "config.json").read_text())
    new = cfg.to_dict()
    differ = [f"{_flag(k)} {old[k]} (now {new[k]})" for k in _differing(old, new)]
    if differ:
        raise LaunchError(
            f"--resume latest: {manager.directory} holds no checkpoint, so this would start fresh, but "
            f"{run_dir} holds a run with other options ({', '.join(differ)}), whose metrics.jsonl and config.json "
            "a fresh start would replace: start it again with its options, train in another --run-dir, or pass "
            "--overwrite")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    last = json.loads(lines[-1]).get("step", -1) if lines else -1
    if last >= old.get("steps", 0) - 1 >= 0:
        raise LaunchError(
            f"--resume latest: the run in {run_dir} finished (step {last}, the last of --steps {old['steps']}) "
            f"without saving a checkpoint, so there is nothing to resume: train on in another --run-dir, or pass "
            "--overwrite to run it again (--checkpoint-every N saves checkpoints)")


def _decide(cfg: TrainConfig, manager: CheckpointManager) -> tuple[Plan, list[pathlib.Path]]:
    """(the plan, the checkpoints to delete first); raises LaunchError."""
    found = manager.checkpoints()
    if cfg.resume is None:
        if found and not cfg.overwrite:
            raise LaunchError(
                f"{manager.directory} holds the checkpoints of another run (steps {_step_list(found)}); a fresh run "
                "would delete them: resume it with --resume latest, train in another --run-dir, or pass "
                "--overwrite to delete them and start fresh")
        return Plan(None), found
    path = _target(cfg, manager)
    if path is None:
        _refuse_another_runs_fresh_start(cfg, manager)
        return Plan(None), []
    step = int(path.name.split("_")[1]) if _STEP.fullmatch(path.name) else -1
    later = [p for p in found if int(p.name.split("_")[1]) > step] if path.parent == manager.directory else []
    if later and not cfg.overwrite:
        # keep_last keeps the highest step numbers: the resumed run's own checkpoints would be deleted at once
        raise LaunchError(
            f"--resume {cfg.resume}: {manager.directory} holds later checkpoints (steps {_step_list(later)}) that "
            "this run would write over; resume the latest, or pass --overwrite to delete them")
    return Plan(path, _changes(cfg, path)), later


def _held(cfg: TrainConfig, manager: CheckpointManager) -> tuple[list[int], bool | None]:
    """A pipeline stage's report to rank 0: the steps its manager has committed, and (``--resume PATH``) whether
    it holds its own copy of that step."""
    steps = sorted(int(p.name.split("_")[1]) for p in manager.checkpoints())
    if cfg.resume is None or cfg.resume == "latest" or cfg.resume.isdigit():
        return steps, None
    mine = pathlib.Path(cfg.resume).parent.parent / manager.directory.name / pathlib.Path(cfg.resume).name
    return steps, (mine / "COMMITTED").is_file()


def _decide_stages(cfg: TrainConfig, directory: pathlib.Path,
                   held: list[tuple[list[int], bool | None]]) -> tuple[Plan, list[int]]:
    """:func:`_decide` for a pipeline run, whose checkpoint of a step is one folder per stage
    (``directory/stage{r}/step_N``): a step is resumable only when every stage committed it. ``held[r]``: stage r's
    :func:`_held`. Returns (the plan, naming stage 0's folder, the steps every stage deletes first)."""
    steps = [set(h[0]) for h in held]
    every, some = set.intersection(*steps), set.union(*steps)
    listing = "; ".join(f"stage{r}: steps {', '.join(map(str, sorted(s))) or 'none'}" for r, s in enumerate(steps))
    if cfg.resume is None:
        if some and not cfg.overwrite:
            raise LaunchError(
                f"{directory} holds the checkpoints of another run ({listing}); a fresh run would delete them: "
                "resume it with --resume latest, train in another --run-dir, or pass --overwrite to delete them and "
                "start fresh")
        return Plan(None), sorted(some)
    if cfg.resume == "latest" and not some:
        return Plan(None), []
    if cfg.resume == "latest":
        if not every:
            raise LaunchError(f"--resume latest: no step was saved by every stage ({listing}): the job stopped while "
                              "saving its first checkpoint; start fresh with --overwrite")
        step = max(every)
        path = CheckpointManager(directory / "stage0").path_for(step)
    elif cfg.resume.isdigit():
        step = int(cfg.resume)
        path = CheckpointManager(directory / "stage0").path_for(step)
    else:
        path = pathlib.Path(cfg.resume)
        if not (_STAGE.fullmatch(path.parent.name) and _STEP.fullmatch(path.name)):
            raise LaunchError(f"--resume {cfg.resume}: a pipeline run resumes each stage from its own checkpoint "
                              "(RUN_DIR/checkpoints/stage{r}/step_N): give latest, a step number, or a stage0/step_N "
                              "path")
        missing = [r for r, h in enumerate(held) if not h[1]]
        if missing:
            raise LaunchError(f"--resume {cfg.resume}: stage(s) {', '.join(map(str, missing))} have no committed "
                              f"{path.name} beside it; every stage must have saved the step")
        step = int(path.name.split("_")[1])
        path = path.parent.parent / "stage0" / path.name
    if cfg.resume.isdigit() and step not in every:
        raise LaunchError(f"--resume {cfg.resume}: step {step} was not saved by every stage ({listing}); use "
                          "--resume latest or a step all of them hold")
    later = sorted(s for s in some if s > step) if path.parent.parent == directory else []
    complete = [s for s in later if s in every]
    if complete and not cfg.overwrite:
        raise LaunchError(
            f"--resume {cfg.resume}: {directory} holds later checkpoints (steps {', '.join(map(str, complete))}) that "
            "this run would write over; resume the latest, or pass --overwrite to delete them")
    unfinished = [s for s in later if s not in every]
    if unfinished:  # a job killed between the stages' saves: no stage can resume from them, this run rewrites them
        log.warning("steps %s were saved by some stages only (%s): deleted, resuming from step %d",
                    ", ".join(map(str, unfinished)), listing, step)
    return Plan(path, _changes(cfg, path)), later


def plan_run(cfg: TrainConfig, rt: Runtime, manager: CheckpointManager, stage_ranks: int = 0) -> Plan:
    """Decide on rank 0, delete what ``--overwrite`` allows, and return the same plan on every rank. Collective.

    ``stage_ranks``: 0 for one manager over the run; else a pipeline's ranks per stage, pp-major (ranks
    ``[s * stage_ranks, (s + 1) * stage_ranks)`` share stage s's manager, ``checkpoints/stage{s}``). Rank 0 decides
    from what the first rank of every stage reports; each stage resumes from, and its first rank deletes, the
    checkpoints of its own with the same step numbers.
    """
    held = rt.all_gather(_held(cfg, manager))[::stage_ranks] if stage_ranks else None
    outcome: Any
    if rt.is_main:
        try:
            if held is not None:
                plan, steps = _decide_stages(cfg, manager.directory.parent, held)
                outcome = (plan, [manager.path_for(s).name for s in steps])
            else:
                plan, doomed = _decide(cfg, manager)
                outcome = (plan, [p.name for p in doomed])
        except LaunchError as e:
            outcome = str(e)
        except (OSError, ValueError) as e:  # every rank must hear of it, or the others wait in all_gather
            outcome = f"--resume {cfg.resume}: {type(e).__name__}: {e}"
    else:
        outcome = None
    outcome = rt.all_gather(outcome)[0]
    if isinstance(outcome, str):
        raise LaunchError(outcome)
    plan, doomed_names = outcome
    if stage_ranks and plan.resume_from is not None:
        plan.resume_from = plan.resume_from.parent.parent / manager.directory.name / plan.resume_from.name
    deletes = rt.rank % stage_ranks == 0 if stage_ranks else rt.is_main
    if deletes:
        doomed = [manager.directory / name for name in doomed_names if (manager.directory / name).exists()]
        for p in doomed:
            shutil.rmtree(p)
        if doomed:
            log.info("deleted checkpoints %s of %s before starting", _step_list(doomed), manager.directory)
    return plan


def write_config(cfg: TrainConfig) -> None:
    """RUN_DIR/config.json: the options in effect (on a resume, from the resumed step on)."""
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")

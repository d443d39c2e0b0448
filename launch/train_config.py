"""The training run's typed configuration, and the command line generated from it.

Every field of :class:`TrainConfig` is a flag (``max_grad_norm`` -> ``--max-grad-norm``) whose help text is the
field's ``help`` metadata, so the flags, their types, defaults and documentation cannot drift apart. A bad flag or
value is a one-line error and exit code 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import pathlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .optimizers import OPTIMIZERS

__all__ = ["MODEL_SHAPE", "PROCESS_OPTIONS", "TrainConfig", "parse_config"]

# the options a checkpoint's tensors are shaped by: a resumed run cannot change them
MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "tie_weights", "param_dtype")
# options of one launch, not of the run it trains: a resume takes every other option from the run's config.json
# unless the command line gives it again (the layout follows the processes this launch has)
LAUNCH_OPTIONS = ("stop_after", "device", "threads", "parallel", "pp_stages", "tp_size", "run_dir", "resume",
                  "overwrite", "compare", "profile_step", "plan", "nproc", "fit", "memory", "allow", "json")
# options that are not the training's: a resume may change them without notice (the launch's, and how the run
# reports and checkpoints)
PROCESS_OPTIONS = (*LAUNCH_OPTIONS, "log_every", "checkpoint_every", "keep_checkpoints", "tensorboard", "wandb")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # model
    n_layer: int = _opt(4, "transformer blocks")
    n_head: int = _opt(4, "attention heads per block")
    n_embd: int = _opt(128, "embedding width (a multiple of --n-head)")
    block_size: int = _opt(128, "context length in bytes")
    tie_weights: bool = _opt(True, "share the embedding matrix with the output head")
    param_dtype: str = _opt("float32", "the parameters' dtype, and so the gradients' and the optimizer state's "
                                       "(bfloat16: half the bytes, bf16 arithmetic throughout)",
                            ("float32", "bfloat16"))
    # memory
    checkpoint_blocks: int = _opt(0, "recompute the forward of the first N blocks in backward instead of keeping "
                                     "their activations (torch.utils.checkpoint, non-reentrant: the same values, "
                                     "for one more forward of those blocks); 0: none")
    autocast: str | None = _opt(None, "run the forward and the loss under torch.autocast with this dtype (mixed "
                                      "precision: the parameters, gradients and state keep --param-dtype); not "
                                      "with --parallel pp, pp+fsdp2", ("bfloat16",))
    # data
    corpus_mb: float = _opt(2.0, "MiB of the Python stdlib's .py sources to train on (a fixed sorted order, then capped)")
    batch_size: int = _opt(16, "global batch in sequences per optimizer step, split over ranks and micro-batches; "
                               "the same batches whatever the world size")
    accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    seed: int = _opt(0, "seed of the initial model and of the batches")
    # optimization
    steps: int = _opt(200, "optimizer steps (the LR schedule's length)")
    stop_after: int | None = _opt(None, "end this process run after this step, with a checkpoint, as a time "
                                        "limit or a preemption would (resume later with --resume latest)")
    lr: float = _opt(3e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final lr as a fraction of --lr (cosine decay)")
    warmup_steps: int = _opt(20, "linear warm-up steps")
    optimizer: str = _opt("adamw", "the optimizer class, in backward and in the standard loop alike: "
                                   + "; ".join(f"{k}: {v.what}" for k, v in OPTIMIZERS.items())
                                   + " (all but adamw and muon need the optimizers extra)", tuple(OPTIMIZERS))
    weight_decay: float = _opt(0.1, "weight decay (decoupled, as AdamW's)")
    beta1: float = _opt(0.9, "the optimizer's beta1")
    beta2: float = _opt(0.95, "the optimizer's beta2")
    max_grad_norm: float | None = _opt(None, "clip gradients to this global norm (off by default)")
    clip_mode: str = _opt("exact", "how --max-grad-norm clips in backward (docs/clipping.md); the standard loop "
                                    "does the same arithmetic",
                          ("exact", "two_pass", "per_parameter", "previous_norm"))
    track_grad_norm: bool = _opt(False, "log the gradient norm every step even without clipping (one more read of "
                                        "the gradients)")
    optimizer_mode: str = _opt("in_backward", "in_backward: dist_optim.InBackwardOptimizer; standard: "
                                              "loss.backward(); opt.step(); opt.zero_grad() with the same "
                                              "--optimizer class",
                               ("in_backward", "standard"))
    bucket_cap_mb: float = _opt(4.0, "in-backward bucket size in MiB of gradients")
    # parallelism
    parallel: str = _opt("auto", "wrapper: fsdp2 (fully_shard per block, then the root), ddp, pp (pipeline "
                                 "stages, one per process), pp+fsdp2 (pipeline stages, each fully_shard-ed over "
                                 "world / --pp-stages processes), tp (tensor parallel over every process: the "
                                 "MLPs sharded, the rest replicated), fsdp2+tp (a (world / --tp-size, --tp-size) "
                                 "mesh: tp, then fully_shard over the first dimension), none (one process); auto = "
                                 "fsdp2 when the world size is > 1, else none",
                         ("auto", "fsdp2", "ddp", "pp", "pp+fsdp2", "tp", "fsdp2+tp", "none"))
    pp_stages: int | None = _opt(None, "--parallel pp, pp+fsdp2: pipeline stages, cut on block boundaries (the first "
                                       "embeds, the last has the head and the loss); pp: none = the world size, the "
                                       "only value one stage per rank allows; pp+fsdp2: required, a divisor of the "
                                       "world size below it")
    microbatches: int | None = _opt(None, "--parallel pp, pp+fsdp2: micro-batches per step, the schedule's split of "
                                          "each pipeline's batch (none = 4)")
    pp_schedule: str | None = _opt(None, "--parallel pp, pp+fsdp2: the torch.distributed.pipelining schedule "
                                         "(none = 1f1b)", ("1f1b", "gpipe"))
    tp_size: int | None = _opt(None, "--parallel fsdp2+tp: tensor-parallel ranks per replica, a divisor of the "
                                     "world size below it (required); --parallel tp: none = the world size")
    device: str = _opt("auto", "auto = cuda:LOCAL_RANK (NCCL) when CUDA is present, else cpu (gloo)",
                       ("auto", "cpu", "cuda"))
    threads: int = _opt(0, "intra-op threads per process; 0 = the cores divided by the local processes")
    # run directory, logging, checkpoints
    run_dir: str = _opt("runs/gpt", "directory for metrics.jsonl, checkpoints and reports")
    log_every: int = _opt(1, "print a progress line every N steps (rank 0); metrics.jsonl gets every step")
    tensorboard: bool = _opt(False, "also write TensorBoard events in RUN_DIR/tensorboard (needs the tensorboard "
                                    "extra: pip install -c constraints.txt -e '.[tensorboard]')")
    wandb: str | None = _opt(None, "also log every step to this Weights & Biases project (needs the wandb extra: "
                                   "pip install -c constraints.txt -e '.[wandb]'; WANDB_MODE=offline logs locally)")
    checkpoint_every: int = _opt(0, "save a checkpoint every N steps (0: never); also at the last step when > 0")
    keep_checkpoints: int = _opt(3, "checkpoints kept on disk (the oldest are deleted)")
    resume: str | None = _opt(None, "'latest' (the newest checkpoint in RUN_DIR/checkpoints, or a fresh start), "
                                    "a checkpoint directory, or a step number. The model's shape (--n-layer, "
                                    "--n-head, --n-embd, --block-size, --tie-weights) must be the run's; every other "
                                    "option given (--lr, the schedule, clipping, batches...) takes effect from the "
                                    "resumed step")
    overwrite: bool = _opt(False, "delete the checkpoints this run would write over: all of RUN_DIR's for a fresh "
                                  "run (without it, a fresh run into a directory holding checkpoints is refused), "
                                  "those after the resumed step with --resume")
    # comparison
    compare: bool = _opt(False, "train the same job with the standard loop and in backward, interleaved step by "
                                "step, and write RUN_DIR/compare/report.{md,json} and compare.png")
    profile_step: int = _opt(-1, "--compare: the step whose memory is profiled (-1: the last one)")
    plan: bool = _opt(False, "plan the job's memory instead of running it: one warm step of each loop on fake "
                             "tensors (dist_optim.plan) for one representative rank of the job the flags describe "
                             "(--parallel over --nproc or torchrun's processes; under torchrun rank 0 plans, the "
                             "others exit); prints the per-rank peaks and writes RUN_DIR/plan.json and plan.png "
                             "(docs/planning.md)")
    nproc: int | None = _opt(None, "--plan, --fit: the number of processes of the job planned, without torchrun (an "
                                   "8-process job planned on a laptop); none = torchrun's WORLD_SIZE, else 1")
    fit: bool = _opt(False, "search the settings that fit --memory per process instead of running (layout, "
                            "--accumulation-steps, --checkpoint-blocks, --clip-mode; with --allow dtypes and low-bit "
                            "states), each planned as --plan plans it; prints the best few and the command of the "
                            "best; exit code 3 when nothing fits (docs/planning.md, Make it fit)")
    memory: str | None = _opt(None, "--fit: the memory budget per process, e.g. 80GiB, 512MiB")
    allow: str = _opt("", "--fit: settings that change the job's arithmetic, comma-separated: bf16-params, "
                          "autocast, low-bit-states (default: only settings bitwise equal to this job's own)")
    json: str | None = _opt(None, "--fit: write the search into this JSON file: fits, budget_bytes, "
                                      "planned_peak_bytes, argv (the best's flags) and every candidate")

    def __post_init__(self) -> None:
        checks = [
            (self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer!r}"),
            (self.n_head >= 1 and self.n_embd % self.n_head == 0,
             f"n_embd must be a multiple of n_head, got {self.n_embd} and {self.n_head}"),
            (self.block_size >= 2, f"block_size must be >= 2, got {self.block_size!r}"),
            (0 <= self.checkpoint_blocks <= self.n_layer,
             f"checkpoint_blocks must be in [0, n_layer={self.n_layer}], got {self.checkpoint_blocks!r}"),
            (0 < self.corpus_mb < math.inf, f"corpus_mb must be > 0 and finite, got {self.corpus_mb!r}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size!r}"),
            (self.accumulation_steps >= 1, f"accumulation_steps must be >= 1, got {self.accumulation_steps!r}"),
            (self.steps >= 1, f"steps must be >= 1, got {self.steps!r}"),
            (0 < self.lr < math.inf, f"lr must be > 0 and finite, got {self.lr!r}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}"),
            (self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf,
             f"max_grad_norm must be > 0 and finite (or none), got {self.max_grad_norm!r}"),
            (0 <= self.weight_decay < math.inf, f"weight_decay must be >= 0 and finite, got {self.weight_decay!r}"),
            (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
             f"beta1 and beta2 must be in [0, 1), got {self.beta1!r} and {self.beta2!r}"),
            (0 < self.bucket_cap_mb < math.inf, f"bucket_cap_mb must be > 0 and finite, got {self.bucket_cap_mb!r}"),
            (self.threads >= 0, f"threads must be >= 0, got {self.threads!r}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every!r}"),
            (self.checkpoint_every >= 0, f"checkpoint_every must be >= 0, got {self.checkpoint_every!r}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints!r}"),
            (self.pp_stages is None or self.pp_stages >= 1, f"pp_stages must be >= 1, got {self.pp_stages!r}"),
            (self.tp_size is None or self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size!r}"),
            (self.nproc is None or self.nproc >= 1, f"nproc must be >= 1, got {self.nproc!r}"),
            (self.microbatches is None or self.microbatches >= 1,
             f"microbatches must be >= 1, got {self.microbatches!r}"),
        ]
        for ok, rule in checks:
            if not ok:
                raise ValueError(rule)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag_type(tp: Any) -> tuple[Any, bool]:
    """(argparse type, optional?) of a field annotation such as ``float | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return tp, False


def _optional(tp: type) -> Any:
    def conv(text: str) -> Any:  # "none" switches an optional setting off
        return None if text.lower() == "none" else tp(text)

    conv.__name__ = tp.__name__  # argparse names the type in its error message
    return conv


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="launch.train",
        description="Train a small byte-level GPT on the Python stdlib sources, with the optimizer step in backward.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        tp, optional = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if tp is bool:
            kwargs.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        else:
            kwargs.update(type=_optional(tp) if optional else tp, metavar=tp.__name__.upper())
        if f.metadata["choices"]:
            kwargs.update(choices=f.metadata["choices"], metavar=None)
        parser.add_argument(flag, **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` into a :class:`TrainConfig`; exits with code 2 and a one-line message on a bad flag/value."""
    parser = build_parser()
    _suggest_flags(parser, sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    if ns.resume is not None:
        _resumed_options(ns, _given(sys.argv[1:] if argv is None else argv))
    if ns.warmup_steps >= ns.steps >= 1:
        # the whole run would warm up, lr never reaching --lr: the warm-up fitted to the run (the same on a resume)
        fitted = ns.steps // 10
        if os.environ.get("RANK", "0") == "0":
            print(f"launch.train: warning: --warmup-steps {ns.warmup_steps} is not below --steps {ns.steps}: the "
                  f"whole run would be warm-up, lr never reaching --lr; warming up over {fitted} steps (a tenth of "
                  "the run) instead. Pass a --warmup-steps below --steps to choose", file=sys.stderr)
        ns.warmup_steps = fitted
    try:
        return TrainConfig(**vars(ns))
    except ValueError as e:
        parser.error(str(e))


def _suggest_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An unknown ``--flag`` close to a known one (``--max_grad_norm``): one line naming the flag meant."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag in known or any(k.startswith(flag) for k in known):
            continue  # a known flag, or an abbreviation argparse resolves (or refuses as ambiguous) itself
        close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1, cutoff=0.8)
        if close:
            parser.error(f"unrecognized argument {flag}: did you mean {close[0]}?")


def _given(argv: list[str]) -> set[str]:
    """The options ``argv`` gives (argparse's abbreviations resolved), not those left at their defaults."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def _resumed_options(ns: argparse.Namespace, given: set[str]) -> None:
    """A resume continues the run: its model's shape, its optimizer and its training options (steps, batches, the
    schedule, checkpointing, logging) are read from RUN_DIR/config.json where the command line does not give them;
    those it gives are applied from the resumed step on (a shape or optimizer given is compared with the
    checkpoint's, which refuses a change). ``--resume latest`` alone continues what Ctrl-C or SIGTERM stopped."""
    recorded = pathlib.Path(ns.run_dir) / "config.json"
    if not recorded.is_file():
        return
    old = json.loads(recorded.read_text())
    for key, value in old.items():
        if key not in given and key not in LAUNCH_OPTIONS and hasattr(ns, key):
            setattr(ns, key, value)

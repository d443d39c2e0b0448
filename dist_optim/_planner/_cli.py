"""``python -m dist_optim.plan``: the memory planner's command line (a Hugging Face ``config.json`` or a builder by
name; the table, JSON or a picture). The planner itself is ``dist_optim._planner._plan``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dist_optim._planner._fit_cli import fit_options, run_fit, write_json
from dist_optim._planner._fsdp2 import BACKENDS
from dist_optim._planner._layouts import NOT_PLANNED, PARALLEL
from dist_optim._planner._pipeline import schedule_class
from dist_optim._planner._plan import MemoryPlan, plan
from dist_optim.engine._options import CLIP_MODES, DEFAULT_BUCKET_CAP_MB

__all__: list[str] = []


# -- the command line -----------------------------------------------------------------------------------------------
PROG = "python -m dist_optim.plan"
HF_EXTRA = "pip install 'dist_optim[hf]'"
POSITIONS = ("max_position_embeddings", "n_positions", "block_size", "max_seq_len", "seq_length")  # models' limits
DEFAULT_SEQ_LEN = 1024  # where the model states no limit


class Refused(SystemExit):
    """A bad input, said in one line (``str``) by :func:`main` on stderr; the process exits with 2, as argparse's."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not argparse's usage block
        raise Refused(f"{message} (see --help)")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default said once: not where the help already says it, nor for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def _class(path: str, flag: str = "--model") -> Any:
    """``torch.optim.AdamW`` or ``package.module:name`` -> the object; a bad name is :class:`Refused`."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise Refused(f"{flag} {path}: expected MODULE:NAME or MODULE.NAME (e.g. launch.gpt:GPT)")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except ImportError as e:
        raise Refused(f"{flag} {path}: cannot import {module!r} ({e}); give an importable MODULE:NAME") from e
    except AttributeError as e:
        raise Refused(f"{flag} {path}: {module!r} has no {name!r}; give an existing MODULE:NAME") from e
    return obj


def _json(text: str, flag: str, fix: str = "give a JSON object, e.g. '{\"vocab_size\": 256}'") -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise Refused(f"{flag}: malformed JSON ({e}); {fix}") from e
    if not isinstance(value, dict):
        raise Refused(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _hf_config(path: str) -> Any:
    """The ``transformers`` config at ``path`` (a ``config.json`` or its folder), read from this disk only."""
    try:
        import transformers
    except ImportError as e:
        raise Refused(f"--hf-config needs transformers, which is not installed: {HF_EXTRA}") from e
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise Refused(f"--hf-config {path}: no such file; give a config.json or the folder that holds it")
    with open(file) as f:
        _json(f.read(), f"--hf-config {file}", "give a model's config.json as transformers writes it")
    try:
        return transformers.AutoConfig.from_pretrained(file)
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Refused(f"--hf-config {file}: not a config transformers can read ({first}); give a model's "
                      "config.json with its model_type") from e


def _hf_model(config_path: str, dtype: torch.dtype, checkpointing: bool) -> tuple[Callable[[], nn.Module], Any]:
    """A builder of a Hugging Face causal LM from its ``config.json`` (no weights read), and the config."""
    config = _hf_config(config_path)
    import transformers

    config.use_cache = False

    def build() -> nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if checkpointing:  # non-reentrant, as the engine needs (transformers 5 renamed the method)
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model
    return build, config


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def _logits_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    if hasattr(logits, "full_tensor"):  # a tensor-parallel model's logits, a DTensor (replicated by the GPT's plan)
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def _output_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``--parallel pp``: the schedule's loss on the last stage, from its logits (as ``_logits_loss``)."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
GPT_BUILDERS = ("launch.gpt:GPT", "launch.gpt.GPT")  # --model names whose TP plan is the trainer's by default
GPT_TP_PLAN = "launch.tensor_parallel:tensor_parallel"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Plan one warm training step's memory, standard loop against in backward, on fake tensors "
                    "(nothing of the model's size is allocated): one process, or one rank of a DDP, FSDP2, "
                    "tensor-parallel, FSDP2 x TP or HSDP job, or each stage rank of a pipeline (--world, --parallel).",
        formatter_class=_Formatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder): "
                       "AutoModelForCausalLM.from_config, loss from labels")
    model.add_argument("--model", metavar="MODULE:CALLABLE", help="a builder of a model mapping token ids "
                       "(batch, seq) to logits (batch, seq, vocab), called with --model-kwargs, e.g. launch.gpt:GPT")
    p.add_argument("--model-kwargs", default="{}", metavar="JSON", help="--model's keyword arguments")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--model: token ids drawn below this (default: --model-kwargs' vocab_size)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="--hf-config: recompute each decoder layer in backward (gradient_checkpointing_enable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the parameters' dtype (the optimizer state follows it)")
    p.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                   help="the forward under torch.autocast with this dtype (mixed precision)")
    p.add_argument("--batch-size", type=_positive, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=_positive, default=None,
                   help="tokens per sequence, at most the model's positions (default: the model's positions, "
                        f"max_position_embeddings or block_size; {DEFAULT_SEQ_LEN} where it states none)")
    p.add_argument("--optimizer", default="torch.optim.AdamW", help="the optimizer class, by name")
    p.add_argument("--lr", type=float, default=1e-3, help="the optimizer's lr (no effect on memory)")
    p.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB, help="the engine's bucket cap, MiB of gradients")
    p.add_argument("--per-parameter", action="store_true", help="step each parameter on its own in backward")
    p.add_argument("--accumulation-steps", type=_positive, default=1, help="micro-batches per step, each --batch-size")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip to this global norm (both loops)")
    p.add_argument("--clip-mode", choices=CLIP_MODES, default="exact", help="how --max-grad-norm clips in backward")
    p.add_argument("--track-grad-norm", action="store_true", help="measure the global norm every step")
    p.add_argument("--world", type=_positive, default=1, help="ranks in the job (with --parallel)")
    p.add_argument("--parallel", choices=(*PARALLEL, *NOT_PLANNED), default="none",
                   help=f"the layout, planned for one rank; planned: {', '.join(PARALLEL)} (the others are refused, "
                        "with the reason)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None,
                   help="--parallel ddp: DDP's bucket_cap_mb (default: DDP's, 25 MiB with a 1 MiB first bucket)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="--parallel ddp: DDP's gradient_as_bucket_view=True")
    p.add_argument("--n-microbatches", type=_positive, default=4,
                   help="--parallel pp: the schedule's micro-batches per step, each --batch-size (the trainer's "
                        "--microbatches)")
    p.add_argument("--pp-schedule", default="1F1B", metavar="NAME",
                   help="--parallel pp: the torch.distributed.pipelining schedule, by torch's name (1F1B, GPipe; "
                        "the others are refused)")
    p.add_argument("--pp-stage-fn", metavar="MODULE:CALLABLE",
                   help="--parallel pp (one stage per rank, --world of them): fn(model, stage_index, num_stages) "
                        "returning that stage's module, e.g. launch.pipeline:gpt_stage for launch.gpt:GPT")
    p.add_argument("--tp-size", type=int, default=None,
                   help="--parallel fsdp2+tp: tensor-parallel ranks per replica, a divisor of --world below it (a "
                        "(world / T, T) mesh); --parallel tp: none or --world")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="the ranks' process-group backend (default: gloo on CPU, nccl on CUDA): under FSDP2, FSDP2 x "
                        "TP and HSDP gloo's buffers inside the all-gather and reduce-scatter are planned, NCCL's not")
    p.add_argument("--shard-size", type=int, default=None,
                   help="--parallel hsdp: the ranks each replica is sharded over, a divisor of --world below it (a "
                        "(world / S, S) mesh of replicas x shards)")
    p.add_argument("--parallelize", metavar="MODULE:CALLABLE", default=None,
                   help="--parallel tp, fsdp2+tp: parallelize(model, tp_mesh) applies the model's tensor-parallel "
                        f"plan (default for --model {GPT_BUILDERS[0]}: the trainer's, {GPT_TP_PLAN})")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="the plan (--fit: the search) as JSON: on stdout instead of the table, or into FILE")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of both loops' memory timelines (--fit: each "
                   "candidate's peak against its cost) (needs matplotlib: pip install 'dist_optim[job]')")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr while planning")
    fit_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> MemoryPlan:
    """Plan from the command line; a bad input is one line on stderr and exit code 2 (:class:`Refused`)."""
    try:
        return _main(argv)
    except Refused as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        raise


def _main(argv: Sequence[str] | None) -> Any:
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.fit:
        model_fn, loss_fn, vocab, positions = _model(args, dtype)
        parallelize = args.parallelize or (GPT_TP_PLAN if args.model in GPT_BUILDERS else None)
        try:
            return run_fit(args, model_fn, loss_fn, vocab, _seq_len(args.seq_len, positions),
                           _class(args.optimizer, "--optimizer"),
                           None if parallelize is None else _class(parallelize, "--parallelize"),
                           _progress(args.quiet))
        except (ValueError, NotImplementedError) as e:
            raise Refused(" ".join(str(e).split())) from e
    pipeline = _pipeline_options(args)
    if args.parallel not in PARALLEL:  # refused before anything is built
        raise Refused(f"--parallel {args.parallel}: not planned ({NOT_PLANNED[args.parallel]}); planned: "
                      f"{', '.join(PARALLEL)}")
    model_fn, loss_fn, vocab, positions = _model(args, dtype)
    seq_len = _seq_len(args.seq_len, positions)
    shape = (args.batch_size, seq_len)

    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)

    if pipeline:
        loss_fn = _output_loss
    parallelize = args.parallelize
    if parallelize is None and args.parallel in ("tp", "fsdp2+tp"):
        if args.model not in GPT_BUILDERS:
            raise Refused(f"--parallel {args.parallel} needs --parallelize MODULE:CALLABLE, a parallelize(model, "
                          f"tp_mesh) with the model's tensor-parallel plan (the default, {GPT_TP_PLAN}, is the "
                          f"plan of --model {GPT_BUILDERS[0]} only)")
        parallelize = GPT_TP_PLAN
    optimizer_class = _class(args.optimizer, "--optimizer")
    parallelize_fn = None if parallelize is None else _class(parallelize, "--parallelize")
    with _progress(args.quiet):
        try:
            result = plan(model_fn, batch_fn, loss_fn, optimizer_class, bucket_cap_mb=args.bucket_cap_mb,
                          per_parameter=args.per_parameter, accumulation_steps=args.accumulation_steps,
                          max_grad_norm=args.max_grad_norm, clip_mode=args.clip_mode,
                          track_grad_norm=args.track_grad_norm,
                          autocast_dtype=None if args.autocast is None else getattr(torch, args.autocast),
                          world_size=args.world, parallel=args.parallel, ddp_bucket_cap_mb=args.ddp_bucket_cap_mb,
                          gradient_as_bucket_view=args.gradient_as_bucket_view, tp_size=args.tp_size,
                          shard_size=args.shard_size, backend=args.backend, parallelize=parallelize_fn,
                          **pipeline, lr=args.lr)
        except (ValueError, NotImplementedError) as e:  # the planner's refusals, one line each
            raise Refused(" ".join(str(e).split())) from e
    result.options.update(batch_size=args.batch_size, seq_len=seq_len, dtype=args.dtype,
                          activation_checkpointing=args.activation_checkpointing,
                          model=args.hf_config or args.model)
    write_json(args.json, result.to_dict(), result.table())
    if args.plot:
        _plot(result, args.plot)
    return result


def _pipeline_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--parallel pp``'s options for ``plan``, checked ({} for the other layouts)."""
    if args.parallel != "pp":
        return {}
    if args.hf_config:
        raise Refused("--parallel pp: give --model and --pp-stage-fn (a Hugging Face model is not cut into "
                      "pipeline stages here)")
    if not args.pp_stage_fn:
        raise Refused("--parallel pp needs --pp-stage-fn MODULE:CALLABLE, fn(model, stage_index, num_stages) "
                      "-> the stage's module (e.g. launch.pipeline:gpt_stage for --model launch.gpt:GPT)")
    try:
        schedule_class(args.pp_schedule)
    except NotImplementedError as e:
        raise Refused(f"--pp-schedule {args.pp_schedule}: {e}") from e
    return {"n_microbatches": args.n_microbatches, "pp_schedule": args.pp_schedule,
            "pp_stage_fn": _class(args.pp_stage_fn, "--pp-stage-fn")}


def _model(args: argparse.Namespace, dtype: torch.dtype
           ) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], torch.Tensor], int, int | None]:
    """The model's builder, its loss, its vocabulary and its positions (``None``: it states none)."""
    if args.hf_config:
        model_fn, config = _hf_model(args.hf_config, dtype, args.activation_checkpointing)
        return model_fn, _hf_loss, config.vocab_size, _limit(vars(config))
    if args.activation_checkpointing:
        raise Refused("--activation-checkpointing: only with --hf-config (a --model checkpoints itself)")
    kwargs = _json(args.model_kwargs, "--model-kwargs")
    builder = _class(args.model, "--model")
    vocab = args.vocab_size or kwargs.get("vocab_size")
    if not vocab:
        raise Refused("--model: give --vocab-size (or vocab_size in --model-kwargs)")
    defaults = {}
    with contextlib.suppress(TypeError, ValueError):  # a builder without a signature states no positions
        defaults = {k: v.default for k, v in inspect.signature(builder).parameters.items()
                    if v.default is not inspect.Parameter.empty}

    def model_fn() -> nn.Module:
        # the default dtype, not .to(dtype): fake parameters cannot be swapped for converted ones
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return builder(**kwargs)
        finally:
            torch.set_default_dtype(before)
    return model_fn, _logits_loss, vocab, _limit({**defaults, **kwargs})


def _limit(settings: dict[str, Any]) -> int | None:
    """The positions a model has, from its config or its builder's arguments (``None``: none stated)."""
    for name in POSITIONS:
        if isinstance(settings.get(name), int) and settings[name] > 0:
            return settings[name]
    return None


def _seq_len(given: int | None, positions: int | None) -> int:
    """``--seq-len``, or the model's positions; refused above them (the real forward would fail)."""
    if given is None:
        return positions or DEFAULT_SEQ_LEN
    if positions is not None and given > positions:
        raise Refused(f"--seq-len {given} is above the model's {positions} positions (its block_size or "
                      f"max_position_embeddings): the job cannot run; give --seq-len {positions} or less")
    return given


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[None]:
    """What the planner traces, on stderr while it runs (its log, which the library never prints)."""
    logger = logging.getLogger("dist_optim._planner")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    before = logger.level
    if not quiet:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def _plot(result: MemoryPlan, path: str) -> None:
    try:
        result.plot(path)
    except ImportError:
        sys.stderr.write(f"{PROG}: --plot {path}: no picture, matplotlib is not installed (the table above is the "
                         "plan); pip install 'dist_optim[job]' for the picture\n")

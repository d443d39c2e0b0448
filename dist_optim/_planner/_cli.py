"""``python -m dist_optim.plan``: the memory planner's command line (a Hugging Face ``config.json`` or a builder by
name; the table, JSON or a picture). The planner itself is ``dist_optim._planner._plan``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dist_optim._planner._plan import CLIP_MODES, MemoryPlan, plan
from dist_optim._planner._fsdp2 import BACKENDS
from dist_optim._planner._layouts import NOT_PLANNED, PARALLEL

__all__: list[str] = []


# -- the command line -----------------------------------------------------------------------------------------------
def _class(path: str) -> Any:
    """``torch.optim.AdamW`` or ``package.module:name`` -> the object."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise ValueError(f"expected module.name or module:name, got {path!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _hf_model(config_path: str, dtype: torch.dtype, checkpointing: bool) -> tuple[Callable[[], nn.Module], int]:
    """A builder of a Hugging Face causal LM from its ``config.json`` (no weights read), and its vocabulary."""
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(f"--hf-config needs transformers: {e}") from e
    config = transformers.AutoConfig.from_pretrained(config_path)
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
    return build, config.vocab_size


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dist_optim.plan",
        description="Plan one warm training step's memory, standard loop against in backward, on fake tensors "
                    "(nothing of the model's size is allocated): one process, or one rank of a DDP, FSDP2, "
                    "tensor-parallel, FSDP2 x TP or HSDP job, or each stage rank of a pipeline (--world, --parallel).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--optimizer", default="torch.optim.AdamW", help="the optimizer class, by name")
    p.add_argument("--lr", type=float, default=1e-3, help="the optimizer's lr (no effect on memory)")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0, help="the engine's bucket cap, MiB of gradients")
    p.add_argument("--per-parameter", action="store_true", help="step each parameter on its own in backward")
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per step, each --batch-size")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip to this global norm (both loops)")
    p.add_argument("--clip-mode", choices=CLIP_MODES, default="exact", help="how --max-grad-norm clips in backward")
    p.add_argument("--track-grad-norm", action="store_true", help="measure the global norm every step")
    p.add_argument("--world", type=int, default=1, help="ranks in the job (with --parallel)")
    p.add_argument("--parallel", choices=(*PARALLEL, *NOT_PLANNED), default="none",
                   help=f"the layout, planned for one rank; planned: {', '.join(PARALLEL)} (the others are refused, "
                        "with the reason)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None,
                   help="--parallel ddp: DDP's bucket_cap_mb (default: DDP's, 25 MiB with a 1 MiB first bucket)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="--parallel ddp: DDP's gradient_as_bucket_view=True")
    p.add_argument("--n-microbatches", type=int, default=4,
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
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of both loops' memory timelines (needs matplotlib)")
    return p


def main(argv: Sequence[str] | None = None) -> MemoryPlan:
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    pipeline: dict[str, Any] = {}
    if args.parallel == "pp":
        if args.hf_config:
            raise SystemExit("--parallel pp: give --model and --pp-stage-fn (a Hugging Face model is not cut into "
                             "pipeline stages here)")
        if not args.pp_stage_fn:
            raise SystemExit("--parallel pp needs --pp-stage-fn MODULE:CALLABLE, fn(model, stage_index, num_stages) "
                             "-> the stage's module (e.g. launch.pipeline:gpt_stage for --model launch.gpt:GPT)")
        from dist_optim._planner._pipeline import schedule_class

        try:
            schedule_class(args.pp_schedule)
        except NotImplementedError as e:
            raise SystemExit(f"--pp-schedule {args.pp_schedule}: {e}") from e
        pipeline = {"n_microbatches": args.n_microbatches, "pp_schedule": args.pp_schedule,
                    "pp_stage_fn": _class(args.pp_stage_fn)}
    if args.hf_config:
        model_fn, vocab = _hf_model(args.hf_config, dtype, args.activation_checkpointing)
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _hf_loss
    else:
        if args.activation_checkpointing:
            raise SystemExit("--activation-checkpointing: only with --hf-config (a --model checkpoints itself)")
        kwargs = json.loads(args.model_kwargs)
        builder = _class(args.model)
        vocab = args.vocab_size or kwargs.get("vocab_size")
        if not vocab:
            raise SystemExit("--model: give --vocab-size (or vocab_size in --model-kwargs)")

        def model_fn() -> nn.Module:
            # the default dtype, not .to(dtype): fake parameters cannot be swapped for converted ones
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                return builder(**kwargs)
            finally:
                torch.set_default_dtype(before)
        loss_fn = _logits_loss
    shape = (args.batch_size, args.seq_len)

    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)

    if args.parallel not in PARALLEL:  # refused before anything is built
        raise SystemExit(f"--parallel {args.parallel}: not planned ({NOT_PLANNED[args.parallel]}); planned: "
                         f"{', '.join(PARALLEL)}")
    if pipeline:
        loss_fn = _output_loss
    parallelize = args.parallelize
    if parallelize is None and args.parallel in ("tp", "fsdp2+tp"):
        if args.model not in GPT_BUILDERS:
            raise SystemExit(f"--parallel {args.parallel} needs --parallelize MODULE:CALLABLE, a parallelize(model, "
                             f"tp_mesh) with the model's tensor-parallel plan (the default, {GPT_TP_PLAN}, is the "
                             f"plan of --model {GPT_BUILDERS[0]} only)")
        parallelize = GPT_TP_PLAN
    result = plan(model_fn, batch_fn, loss_fn, _class(args.optimizer), bucket_cap_mb=args.bucket_cap_mb,
                  per_parameter=args.per_parameter, accumulation_steps=args.accumulation_steps,
                  max_grad_norm=args.max_grad_norm, clip_mode=args.clip_mode,
                  track_grad_norm=args.track_grad_norm,
                  autocast_dtype=None if args.autocast is None else getattr(torch, args.autocast),
                  world_size=args.world, parallel=args.parallel, ddp_bucket_cap_mb=args.ddp_bucket_cap_mb,
                  gradient_as_bucket_view=args.gradient_as_bucket_view, tp_size=args.tp_size,
                  shard_size=args.shard_size, backend=args.backend,
                  parallelize=None if parallelize is None else _class(parallelize),
                  **pipeline, lr=args.lr)
    result.options.update(batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                          activation_checkpointing=args.activation_checkpointing,
                          model=args.hf_config or args.model)
    if args.plot:
        result.plot(args.plot)
    sys.stdout.write((json.dumps(result.to_dict(), indent=2) if args.json else result.table()) + "\n")
    return result

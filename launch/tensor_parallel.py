"""``--parallel tp`` and ``fsdp2+tp``: the GPT's MLPs sharded over the tensor-parallel ranks, every other parameter a
replicated DTensor; under ``fsdp2+tp`` on a ``("dp", "tp")`` mesh, TP first, then ``fully_shard`` per block and the
root on "dp" (torchtitan's order). The TP ranks of a replica see the same batch; the names of the parameters stay
the plain model's, so a checkpoint resumes on another layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .runtime import LaunchError, Runtime

__all__ = ["TENSOR_PARALLEL", "batch_split", "check_tp", "data_parallel", "parallelize", "tensor_parallel"]

TENSOR_PARALLEL = ("tp", "fsdp2+tp")  # the --parallel values that shard matmuls


def check_tp(cfg: Any, rt: Runtime, parallel: str) -> int:
    """The tensor-parallel size (0 when ``parallel`` is not one of :data:`TENSOR_PARALLEL`), or a LaunchError
    naming the setting the run cannot take."""
    if parallel not in TENSOR_PARALLEL:
        if cfg.tp_size is not None:
            raise LaunchError(f"--tp-size only applies to --parallel fsdp2+tp, and this run is --parallel {parallel}; "
                              "drop it (pipeline stages with tensor parallel are not supported)")
        return 0
    if parallel == "tp":
        if cfg.tp_size is not None and cfg.tp_size != rt.world:
            raise LaunchError(f"--parallel tp runs one TP rank per process: --tp-size must be none or the number of "
                              f"processes ({rt.world}), got {cfg.tp_size}; use --parallel fsdp2+tp for a 2-D mesh")
        size = rt.world
    else:
        size = cfg.tp_size
        if size is None:
            raise LaunchError(f"--parallel fsdp2+tp needs --tp-size T: the {rt.world} processes form a (world / T, T) "
                              "mesh, fully_shard over its first dimension, tensor parallel over its second")
        if rt.world % size or size >= rt.world:
            raise LaunchError(f"--tp-size {size} must divide the number of processes ({rt.world}) and be below it, "
                              "so that fsdp2+tp has at least 2 replicas to shard over; use --parallel tp for one")
    # mlp.0 is split by its 4 * n_embd output columns and mlp.2 by as many input rows: equal shards per rank
    if cfg.n_embd % size:
        raise LaunchError(f"--n-embd {cfg.n_embd} must be a multiple of the tensor-parallel size {size} "
                          f"({'--tp-size' if parallel == 'fsdp2+tp' else 'the number of processes'})")
    return size


def data_parallel(rt: Runtime, parallel: str, tp_size: int) -> tuple[int, int]:
    """(this rank's data-parallel replica, the number of replicas): the TP ranks of a replica share its batch.
    The mesh is laid out row-major, ``("dp", "tp")``: ranks ``[d * T, (d + 1) * T)`` are replica d."""
    if parallel in TENSOR_PARALLEL:
        return rt.rank // tp_size, rt.world // tp_size
    return rt.rank, rt.world


def batch_split(cfg: Any, rt: Runtime, parallel: str, tp_size: int) -> tuple[int, int]:
    """:func:`data_parallel`, checked: the global batch must split evenly over the replicas and the micro-batches
    (``--accumulation-steps``), or a LaunchError naming both."""
    dp_rank, dp_size = data_parallel(rt, parallel, tp_size)
    if cfg.batch_size % (dp_size * cfg.accumulation_steps):
        ranks = "data-parallel replicas (world / TP size)" if tp_size else "world size"
        unit = dp_size * cfg.accumulation_steps
        nearest = max(unit, round(cfg.batch_size / unit) * unit)
        raise LaunchError(f"--batch-size {cfg.batch_size} must be a multiple of the {ranks} x --accumulation-steps "
                          f"= {dp_size} x {cfg.accumulation_steps} = {unit}: pass e.g. --batch-size {nearest}")
    return dp_rank, dp_size


def _replicate(module: nn.Module, mesh, shared: dict[int, tuple[nn.Parameter, nn.Parameter]],
               unwrap: bool = True) -> None:
    """``module``'s own parameters as ``Replicate`` DTensors, run on the replicated activations: plain inputs are
    wrapped as ``Replicate`` and (``unwrap``) the output is unwrapped, so its neighbours see plain tensors as they do
    around the sharded MLP. ``shared`` maps the plain parameters already replaced to their DTensors (keeps a tied
    head tied)."""
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        distribute_module,
        distribute_tensor,
    )

    def partition(name: str, mod: nn.Module, mesh) -> None:
        if mod is not module:
            return
        for pname, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in shared:  # the plain parameter kept alive with it: its id stays unique
                shared[id(p)] = (p, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]), p.requires_grad))
            mod.register_parameter(pname, shared[id(p)][1])

    def inputs(mod: nn.Module, args: tuple, mesh) -> tuple:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def outputs(mod: nn.Module, out: Any, mesh) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, partition, inputs, outputs if unwrap else None)


def _to_local(module: nn.Module, args: tuple, out: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return out.to_local() if isinstance(out, DTensor) else out


def tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """``model`` (a :class:`launch.gpt.GPT`) tensor parallel on the 1-D ``tp_mesh``: each block's MLP sharded
    (``ColwiseParallel`` then ``RowwiseParallel``), every other parameter a replicated DTensor; the logits are a
    replicated DTensor (:func:`parallelize` unwraps them). The memory planner takes it as ``parallelize(model,
    mesh)`` (``dist_optim.plan(..., parallelize=tensor_parallel)``). Collective: call on every rank."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # Megatron's MLP: mlp.0 split by output columns, GELU on each rank's columns, mlp.2 by input rows and its
    # output all-reduced. Attention stays replicated: the fused qkv Linear's rows are [q; k; v], so a Shard(0) of it
    # would give rank 0 all of q and half of k (with 2 ranks), not its heads' q, k and v; a correct split needs a
    # strided layout (or separate q, k, v Linears, which would rename the parameters and break checkpoints).
    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # the rest on every TP rank, as replicated DTensors: the library and torch's clipping and fused AdamW then see
    # one kind of tensor (plain tensors next to DTensors are refused unless allow_local_steps), and each rank
    # computes the same gradient for them from the same batch and the all-reduced activations
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)) and not any(
                hasattr(p, "placements") for p in module.parameters(recurse=False)):
            _replicate(module, tp_mesh, shared, unwrap=module is not model.head)
    return model


def parallelize(model: nn.Module, parallel: str, rt: Runtime, tp_size: int) -> nn.Module:
    """``model`` (a :class:`launch.gpt.GPT` on the run's device) tensor parallel over ``tp_size`` ranks
    (:func:`tensor_parallel`), and for ``fsdp2+tp`` then ``fully_shard``-ed over the replicas. Collective: call on
    every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel == "tp":
        tp_mesh, dp_mesh = init_device_mesh(rt.device.type, (rt.world,), mesh_dim_names=("tp",)), None
    else:
        mesh = init_device_mesh(rt.device.type, (rt.world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    tensor_parallel(model, tp_mesh)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    # the logits leave the model as a plain tensor, unwrapped after FSDP2's own post-forward hook: FSDP2 warns of a
    # root output that is a view, which to_local() returns
    model.register_forward_hook(_to_local)
    return model

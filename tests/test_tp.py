"""Tensor parallel (``parallelize_module``), alone and under FSDP2 on a 2-D mesh: ``InBackwardOptimizer`` ends
bitwise where the same parallelism ends with the standard loop (same optimizer class and kernel).

SequenceParallel norms are the case to watch: their parameters are ``Replicate`` and their gradients ``Partial``
(each rank holds its term of the sum over the sequence shards). The standard loop's optimizer reduces them inside
DTensor's ops; a step on the local partial gradient lets the replicas drift apart, which the control scenario
shows. Every scenario compares the full parameters and optimizer state (``full_tensor()``) with ``torch.equal``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import ADAMW, RESHARD_TOLERANCE, SGD_MOMENTUM, STEPS, WIDTH
from torch import nn

import dist_optim

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

if dist.is_available():
    from test_fsdp2 import (
        _assert_same,
        _clip_exact,
        _clip_per_parameter,
        _clip_value,
        _track_only,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

TINY_BUCKETS = 1e-3  # MiB: a few tensors per bucket, so buckets complete (and step) in the middle of backward
SEQUENCE = 8  # tokens per sequence: 2 or 4 sequence shards
BATCH = 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out = self.norm(x)
        return out.to_local() if isinstance(out, DTensor) else out


def _parallelize(model: Net, tp_mesh, sequence_parallel: bool) -> Net:
    """torchtitan's layout: Colwise up, Rowwise down; with ``sequence_parallel`` the norms run on sequence shards
    (``Replicate`` parameters, ``Partial`` gradients), else they stay plain modules on replicated activations."""
    if sequence_parallel:
        block_plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                      "down": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})
    else:
        block_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    return model


def _twins(tp_mesh, *, sequence_parallel: bool, dp_mesh=None):
    torch.manual_seed(0)
    base = Net()
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    for m in (a, b):
        _parallelize(m, tp_mesh, sequence_parallel)
        if dp_mesh is not None:  # TP first, then fully_shard on the data-parallel dimension
            for block in m.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(m, mesh=dp_mesh)
    return a, b, initial


def _data(tp_mesh, dp_rank: int, sequence_parallel: bool, steps: int = STEPS) -> list[torch.Tensor]:
    """The same batch on every rank of a TP group (each data-parallel replica its own); with sequence parallelism
    each TP rank gets its shard of the sequence."""
    g = torch.Generator().manual_seed(10 + dp_rank)
    full = [torch.randn(BATCH, SEQUENCE, WIDTH, generator=g) for _ in range(steps)]
    if not sequence_parallel:
        return full
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    return [x.chunk(tp, dim=1)[rank].contiguous() for x in full]


def _dp_rank(dp_mesh) -> int:
    """This rank's data-parallel replica: its coordinate on the (possibly 2-D, HSDP) data-parallel mesh."""
    if dp_mesh is None:
        return 0
    index = 0
    for coordinate, size in zip(dp_mesh.get_coordinate(), dp_mesh.shape):  # row-major over the mesh's own shape
        index = index * size + coordinate
    return index


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _parity(ctx, cls, kwargs, *, sequence_parallel: bool = True, ib: dict | None = None,
            reference: Callable | None = None, want_norm: bool = False) -> None:
    """In backward on one copy, the standard loop on the other, same data; ``reference(params)`` clips the
    standard side before its step and returns the norm ``clip_grad_norm_`` reports (compared with ``grad_norm``)."""
    tp_mesh, dp_mesh = ctx["tp"], ctx.get("dp")
    a, b, initial = _twins(tp_mesh, sequence_parallel=sequence_parallel, dp_mesh=dp_mesh)
    if sequence_parallel:  # the case this file is about: a Replicate parameter gets a Partial gradient
        want = (*[Replicate()] * (dp_mesh.ndim - 1), Shard(0), Replicate()) if dp_mesh is not None else (Replicate(),)
        assert tuple(a.norm.weight.placements) == want, a.norm.weight.placements
    opt = dist_optim.InBackwardOptimizer(a, cls, **{"bucket_cap_mb": TINY_BUCKETS, **(ib or {})}, **kwargs)
    # the standard loop needs one optimizer per kind when plain tensors sit next to DTensors: torch's foreach and
    # fused ops refuse lists that mix them
    kinds = [[(n, p) for n, p in b.named_parameters() if isinstance(p, DTensor) == dt] for dt in (True, False)]
    refs = [cls(named, **kwargs) for named in kinds if named]
    dp_rank = _dp_rank(dp_mesh)
    data = _data(tp_mesh, dp_rank, sequence_parallel)
    partial_seen = False
    for k, x in enumerate(data):
        _loss(a, x).backward()
        left = [n for n, p in a.named_parameters() if p.grad is not None]
        assert not left, f"gradients left after an in-backward step: {left}"
        _loss(b, x).backward()
        partial_seen = partial_seen or any(
            isinstance(p.grad, DTensor) and any(isinstance(pl, Partial) for pl in p.grad.placements)
            for p in b.parameters())
        ref_norm = reference(list(b.parameters()), None) if reference is not None else None
        for ref in refs:
            ref.step()
            ref.zero_grad()
        if want_norm:
            got, expected = opt.grad_norm.full_tensor(), ref_norm.full_tensor()
            assert torch.equal(got, expected), f"step {k}: grad_norm {got.item()!r}, reference {expected.item()!r}"
    if sequence_parallel and dp_mesh is None:
        assert partial_seen, "no Partial gradient in the standard loop: the scenario tests nothing"
    if len(refs) == 1:
        _assert_same(a, [opt.state_dict()], b, [refs[0].state_dict()], initial)
    else:
        _assert_same_by_name(a, opt.state_dict(), b, [ref.state_dict() for ref in refs])
    if dp_mesh is None:
        for name, p in a.named_parameters():  # replicated tensors, DTensors or plain ones, stay equal on every rank
            if not isinstance(p, DTensor) or p.placements == (Replicate(),):
                _assert_replicas_equal(name, _local(p), tp_mesh.get_group())


def _by_name(sd: dict) -> dict[str, dict]:
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return {n: sd["state"][i] for n, i in zip(names, ids)}


def _local(v):
    return v.to_local() if isinstance(v, DTensor) else v


def _full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def _assert_same_by_name(a: nn.Module, sd: dict, b: nn.Module, ref_sds: list[dict]) -> None:
    """Parameters and state compared by parameter name (the standard side's state split over optimizers)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(_full(p.detach()), _full(q.detach())), f"param {name} differs"
    mine, theirs = _by_name(sd), {n: st for r in ref_sds for n, st in _by_name(r).items()}
    assert mine.keys() == theirs.keys()
    for name, state in mine.items():
        assert state.keys() == theirs[name].keys()
        for key, v in state.items():
            assert torch.equal(_full(v), _full(theirs[name][key])), f"state[{name}][{key}] differs"


def _replica_drift(local: torch.Tensor, group) -> float:
    """The largest difference between this rank's copy of a replicated tensor and any other rank's."""
    high, low = local.detach().clone(), local.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return (high - low).abs().max().item()


def _assert_replicas_equal(name: str, local: torch.Tensor, group) -> None:
    drift = _replica_drift(local, group)
    assert drift == 0, f"{name}: the replicas differ by {drift}"


# -- plain parameters in a TP job ---------------------------------------------------------------------------------
def _refuse_plain_norm(ctx) -> None:
    a, _, _ = _twins(ctx["tp"], sequence_parallel=False)
    with pytest.raises(RuntimeError, match=r"tensor parallel.*parallelize_module.*allow_local_steps=True"):
        dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW)


def _refuse_norms_over_plain_and_dtensors(ctx) -> None:
    a, _, _ = _twins(ctx["tp"], sequence_parallel=False)
    for option in ({"max_grad_norm": 1.0}, {"track_grad_norm": True}, {"nonfinite": "skip"}):
        with pytest.raises(NotImplementedError, match=r"plain tensors next to DTensor.*tensor-parallel.*Sequence"):
            dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, allow_local_steps=True, **option, **ADAMW)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, allow_local_steps=True, **ADAMW)
    with pytest.raises(NotImplementedError, match=r"plain tensors next to DTensor"):
        opt.configure_clipping(max_grad_norm=1.0)
    assert opt.max_grad_norm is None
    opt.remove()


def _refuse_value_clipping(ctx) -> None:
    """Value clipping on a Partial gradient fails in DTensor's in-place clamp, in the standard loop's
    clip_grad_value_ too: refused at construction, where nothing has stepped."""
    a, b, _ = _twins(ctx["tp"], sequence_parallel=True)
    b(_data(ctx["tp"], 0, True)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"in-place operations that require placement changes"):
        nn.utils.clip_grad_value_(b.parameters(), 0.01)
    with pytest.raises(NotImplementedError, match=r"max_grad_value with 8 replicated DTensor.*tensor parallel"):
        dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, max_grad_value=0.01, **ADAMW)
    opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, **ADAMW)
    with pytest.raises(NotImplementedError, match=r"max_grad_value"):
        opt.configure_clipping(max_grad_value=0.01)
    opt.remove()


# -- the options fingerprint on a 2-D mesh ------------------------------------------------------------------------
def _options_differ_on_one_rank(ctx) -> None:
    """On (dp=2, tp=2), rank 3 alone with another lr: every rank raises, the ranks whose groups hold rank 3 name the
    option (its dp and its tp group), the others say that it differs elsewhere on the mesh."""
    a, _, _ = _twins(ctx["tp"], sequence_parallel=True, dp_mesh=ctx["dp"])
    lr = 0.02 if ctx["rank"] == 3 else 0.01
    with pytest.raises(ValueError, match=r"different options on") as raised:
        dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, lr=lr, fused=True)
    message = str(raised.value)
    if ctx["rank"] == 0:
        assert "other ranks of this device mesh" in message, message
    else:
        peer = {1: 1, 2: 2, 3: 1}[ctx["rank"]]  # rank 3 names its dp group's first mismatch: ranks 1 and 3
        assert f"param_groups[0].lr: 0.01 on ranks [{peer}]; 0.02 on ranks [3]" in message, message
    dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, lr=0.01, fused=True).remove()  # nothing stayed attached


def _options_per_stage_of_a_larger_mesh(ctx) -> None:
    """The parameters' mesh is a 2-D slice of a larger one (a pipeline stage's HSDP mesh, of (pp=2, replicate=2,
    shard=1)): the check runs within the slice, so stages with their own options are accepted (the default group
    used to compare across stages and refuse them), and a mismatch inside a stage is still refused."""
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
    stage = mesh.get_coordinate()[0]
    model = Net()
    fully_shard(model, mesh=mesh["replicate", "shard"])
    dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=0.01 * (stage + 1), fused=True).remove()
    replica = mesh.get_coordinate()[1]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.lr: "):
        dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=0.01 * (replica + 1), fused=True)


# -- checkpoints: a TP run resumes on another layout ---------------------------------------------------------------
HALF = 2  # steps before the checkpoint, and after it


def _global_loss(model: nn.Module, xs: list[torch.Tensor], tp: int) -> torch.Tensor:
    """One process's loss equal to what the parallel job minimises: each TP rank's loss is the mean over its
    sequence shard (their sum: ``tp`` times the mean over the whole sequence), FSDP2 averages the replicas' batches."""
    return tp * model(torch.cat(xs)).square().mean()


def _parallel_run(ctx, *, tmp: str, save_at: int | None, load: bool) -> None:
    """FSDP2 x TP (4 ranks) or TP alone (2 ranks), sequence parallel, in backward: trains 2 * HALF steps, saving
    after ``save_at`` or loading first (and then training the second half); rank 0 writes the final parameters."""
    from pathlib import Path

    from dist_optim.checkpoint import load as load_checkpoint
    from dist_optim.checkpoint import save as save_checkpoint

    tp_mesh, dp_mesh = ctx["tp"], ctx.get("dp")
    torch.manual_seed(7 if load else 0)  # a resumed model starts from other weights: the checkpoint must set them
    model = _parallelize(Net(), tp_mesh, sequence_parallel=True)
    if dp_mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ADAMW)
    data = _data(tp_mesh, _dp_rank(dp_mesh), True, steps=2 * HALF)
    start = 0
    if load:
        load_checkpoint(Path(tmp) / "ck_single", model=model, optimizer=opt)
        start = HALF
    for step in range(start, 2 * HALF):
        _loss(model, data[step]).backward()
        if save_at is not None and step + 1 == save_at:
            save_checkpoint(Path(tmp) / f"ck_{ctx['world']}", model=model, optimizer=opt)
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    if ctx["rank"] == 0:
        torch.save(params, Path(tmp) / f"{'resumed' if load else 'ref'}_{ctx['world']}.pt")


def _single_process(tmp, *, tp: int, dp: int, save_at: int | None, load_from: str | None) -> dict:
    """The same training on one process, plain model: the global batch of each step, the job's loss."""
    from dist_optim.checkpoint import load as load_checkpoint
    from dist_optim.checkpoint import save as save_checkpoint

    torch.manual_seed(7 if load_from else 0)
    model = Net()
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ADAMW)
    replicas = [_data(None, d, False, steps=2 * HALF) for d in range(dp)]
    start = 0
    if load_from is not None:
        load_checkpoint(tmp / load_from, model=model, optimizer=opt)
        start = HALF
    for step in range(start, 2 * HALF):
        _global_loss(model, [r[step] for r in replicas], tp).backward()
        if save_at is not None and step + 1 == save_at:
            save_checkpoint(tmp / "ck_single", model=model, optimizer=opt)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **RESHARD_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_fsdp2_x_tp_checkpoint_resumes_on_one_process(ranks, tmp_path):
    """(dp=2, tp=2) on 4 ranks, saved after HALF steps, resumed on one process with a plain model: equal to the
    uninterrupted 4-rank run within the reshard tolerance (another reduction order)."""
    ranks.run(4, _on_mesh, scenario=_parallel_run, two_d=True, tmp=str(tmp_path), save_at=HALF, load=False)
    got = _single_process(tmp_path, tp=2, dp=2, save_at=None, load_from="ck_4")
    _assert_close(got, torch.load(tmp_path / "ref_4.pt", weights_only=True))


def test_one_process_checkpoint_resumes_under_tp(ranks, tmp_path):
    """And back: a plain one-process run saved after HALF steps, resumed on TP alone with SequenceParallel norms
    (2 ranks): equal to the uninterrupted one-process run within the reshard tolerance."""
    want = _single_process(tmp_path, tp=2, dp=1, save_at=HALF, load_from=None)
    ranks.run(2, _on_mesh, scenario=_parallel_run, two_d=False, tmp=str(tmp_path), save_at=None, load=True)
    _assert_close(torch.load(tmp_path / "resumed_2.pt", weights_only=True), want)


# -- the control: a step on the local partial gradient fails these tests ------------------------------------------
def _control_local_partial_step(ctx) -> dict:
    """The fast path made to step ``grad._local_tensor`` whatever its placements (the code before issue 21): the
    norms' replicas drift apart and the comparison with the standard loop fails."""
    from dist_optim.engine import _stepper

    mesh = init_device_mesh("cpu", (ctx.world,))
    original = _stepper.same_layout
    _stepper.same_layout = lambda p, grad: isinstance(grad, DTensor)  # the layout is never looked at
    try:
        a, b, _ = _twins(mesh, sequence_parallel=True)
        opt = dist_optim.InBackwardOptimizer(a, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKETS, **ADAMW)
        ref = torch.optim.AdamW(b.named_parameters(), **ADAMW)
        for x in _data(mesh, 0, True, steps=4):
            _loss(a, x).backward()
            _loss(b, x).backward()
            ref.step()
            ref.zero_grad()
    finally:
        _stepper.same_layout = original
    drift = _replica_drift(a.norm.weight.to_local(), mesh.get_group())
    with pytest.raises(AssertionError, match=r"norm\.weight differs"):
        _assert_same(a, [opt.state_dict()], b, [ref.state_dict()], {})
    off = (a.norm.weight.full_tensor() - b.norm.weight.full_tensor()).abs().max().item()
    return {"drift": drift, "vs_standard": off}


def test_control_a_step_on_the_local_partial_gradient_fails(ranks):
    # the shared group: the patch is undone in the scenario (finally), and every rank runs the same collectives
    results = ranks.run(2, _control_local_partial_step)
    drift = results[0]["drift"]
    assert drift > 1e-3, f"the control's replicas drift by {drift} only: the tests would not notice"


# -- the scenarios ------------------------------------------------------------------------------------------------
def _scenarios() -> list[tuple[int, str, Callable, dict]]:
    adamw = dict(cls=torch.optim.AdamW, kwargs=ADAMW)
    sgd = dict(cls=torch.optim.SGD, kwargs=SGD_MOMENTUM)
    exact = dict(ib={"max_grad_norm": 0.05}, reference=_clip_exact, want_norm=True)
    s = [
        (2, "tp/sequence-parallel/AdamW-fused", _parity, adamw),
        (2, "tp/sequence-parallel/SGD-momentum-foreach", _parity, sgd),
        (2, "tp/sequence-parallel/AdamW-fused/per_parameter-mode", _parity, dict(adamw, ib={"per_parameter": True})),
        (2, "tp/sequence-parallel/AdamW-fused/clip-exact", _parity, dict(adamw, **exact)),
        (2, "tp/sequence-parallel/SGD-momentum-foreach/clip-exact", _parity, dict(sgd, **exact)),
        (2, "tp/sequence-parallel/AdamW-fused/clip-per_parameter", _parity,
         dict(adamw, ib={"max_grad_norm": 0.05, "clip_mode": "per_parameter"}, reference=_clip_per_parameter)),
        (2, "tp/sequence-parallel/clip-value-refused", _refuse_value_clipping, {}),
        (4, "fsdp2xtp/sequence-parallel/AdamW-fused/clip-value", _parity,
         dict(adamw, ib={"max_grad_value": 0.01}, reference=_clip_value)),
        (2, "tp/sequence-parallel/AdamW-fused/track_grad_norm", _parity,
         dict(adamw, ib={"track_grad_norm": True}, reference=_track_only, want_norm=True)),
        (2, "tp/plain-norms-allow_local_steps/AdamW-fused", _parity,
         dict(adamw, sequence_parallel=False, ib={"allow_local_steps": True})),
        (2, "tp/plain-norms-allow_local_steps/SGD-momentum-foreach", _parity,
         dict(sgd, sequence_parallel=False, ib={"allow_local_steps": True})),
        (2, "tp/plain-norms/refused", _refuse_plain_norm, {}),
        (2, "tp/plain-norms/norms-refused", _refuse_norms_over_plain_and_dtensors, {}),
        (4, "tp/sequence-parallel/AdamW-fused", _parity, adamw),
        (4, "fsdp2xtp/sequence-parallel/AdamW-fused", _parity, adamw),
        (4, "fsdp2xtp/sequence-parallel/SGD-momentum-foreach", _parity, sgd),
        (4, "fsdp2xtp/sequence-parallel/AdamW-fused/clip-exact", _parity, dict(adamw, **exact)),
        (4, "fsdp2xtp/sequence-parallel/SGD-momentum-foreach/track_grad_norm", _parity,
         dict(sgd, ib={"track_grad_norm": True}, reference=_track_only, want_norm=True)),
        (4, "fsdp2xtp/options-differ-on-one-rank", _options_differ_on_one_rank, {}),
        (4, "hsdpxtp/sequence-parallel/AdamW-fused/clip-exact", _parity, dict(adamw, **exact)),
        (4, "fingerprint/per-stage-of-a-pipeline-x-hsdp-mesh", _options_per_stage_of_a_larger_mesh, {}),
    ]
    return s


def _on_mesh(ctx, scenario: Callable, two_d: bool, **kwargs) -> None:
    """Runs on each rank: TP over every rank, or (dp=2, tp=2) for a 2-D scenario."""
    if two_d == "hsdp":  # 2 replicas x 1 shard x 2 TP ranks: HSDP's 2-D mesh for FSDP2, the parameters on 3-D
        mesh = ctx.cached("hsdp-tp-mesh", lambda: init_device_mesh(
            "cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp")))
        meshes = {"dp": mesh["replicate", "shard"], "tp": mesh["tp"]}
    elif two_d:
        mesh = ctx.cached("dp-tp-mesh", lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        meshes = {"dp": mesh["dp"], "tp": mesh["tp"]}
    else:
        meshes = {"tp": ctx.cached("tp-mesh", lambda: init_device_mesh("cpu", (ctx.world,)))}
    scenario({"rank": ctx.rank, "world": ctx.world, **meshes}, **kwargs)


SCENARIOS = [
    pytest.param(world, fn, kwargs, "hsdp" if name.startswith("hsdp") else name.startswith("fsdp2xtp"),
                 id=f"{world}ranks/{name}")
    for world, name, fn, kwargs in (_scenarios() if dist.is_available() else [])
]


@pytest.mark.parametrize("world, scenario, kwargs, two_d", SCENARIOS)
def test_tp_equals_the_standard_loop(ranks, world, scenario, kwargs, two_d):
    ranks.run(world, _on_mesh, scenario=scenario, two_d=two_d, **kwargs)

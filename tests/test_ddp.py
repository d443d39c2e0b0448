"""DDP: the step runs from a communication hook, after each bucket's all-reduce, on the averaged gradient.

Every scenario compares InBackwardOptimizer on a DDP model with the same DDP wrapping and the standard loop
(``loss.backward(); opt.step(); opt.zero_grad()``), bitwise, on 2 real gloo ranks that feed different data. All
scenarios run inside one process group (start-up is the slow part); a failure lists every scenario that failed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_optim
from helpers import batches, loss_of, make_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

OPTIMIZERS = {
    "AdamW-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "Adam-foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "Adagrad-fused": (torch.optim.Adagrad, dict(lr=0.1, fused=True)),
    "RMSprop-foreach": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, foreach=True)),
}


def _pair(ddp_kwargs, ignore=()):
    base = make_model(width=16)
    wrapped = []
    for _ in range(2):
        module = copy.deepcopy(base)
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
        wrapped.append(DDP(module, **ddp_kwargs))
    return wrapped


def _check_equal(a, b, opt, ref_opt):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item()}"
        assert p.grad is None, f"{name}.grad left after backward"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, state in ref_sd["state"].items():
        for key, v in state.items():
            assert torch.equal(sd["state"][k][key], v), f"state[{k}][{key}]"


def _train(a, b, opt, ref_opt, rank, steps=3, micro=1, clip=None):
    data = batches(steps * micro, width=16, seed=10 + rank)
    norms = []
    for s in range(steps):
        for m in range(micro):
            batch = data[s * micro + m]
            last = m == micro - 1
            for model in (a, b):
                if last:
                    (loss_of(model, batch) / micro).backward()
                else:
                    with model.no_sync():
                        (loss_of(model, batch) / micro).backward()
        if clip is not None:
            norms.append(torch.equal(opt.grad_norm, nn.utils.clip_grad_norm_(b.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(norms), f"grad norms equal per step: {norms}"  # after the loop: a rank leaving early would hang
    moved = make_model(width=16)
    assert any(not torch.equal(p, q) for p, q in zip(a.module.parameters(), moved.parameters()))


class Branchy(nn.Module):
    """Parameters used unevenly: ``never`` on no rank, ``rank0`` on rank 0 only, ``odd`` on odd steps only (so
    unused everywhere at step 0 and again at step 2, after it has optimizer state), ``alternate`` by one rank per
    step. ``static=True`` keeps only the usage that does not change with the step (for ``static_graph``)."""

    def __init__(self, static: bool = False, width: int = 16) -> None:
        super().__init__()
        self.static = static
        self.trunk = nn.Linear(width, width)
        self.never = nn.Linear(width, width)
        self.rank0 = nn.Linear(width, width)
        self.odd = nn.Linear(width, width)
        self.alternate = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = torch.tanh(self.trunk(x))
        if dist.get_rank() == 0:
            x = torch.tanh(self.rank0(x))
        if not self.static and step % 2 == 1:
            x = torch.tanh(self.odd(x))
        if not self.static and (step + dist.get_rank()) % 2 == 0:
            x = torch.tanh(self.alternate(x))
        return self.head(x)


def _unused_pair(static=False, **ddp_kwargs):
    torch.manual_seed(0)
    base = Branchy(static)
    return [DDP(copy.deepcopy(base), bucket_cap_mb=0.002, **ddp_kwargs) for _ in range(2)]


def _train_unused(a, b, opt, ref_opt, rank, steps=4, micro=1, clip=None):
    never = a.module.never.weight.detach().clone()
    data = batches(steps * micro, width=16, seed=10 + rank)
    norms = []
    for s in range(steps):
        for m in range(micro):
            x, y = data[s * micro + m]
            for model in (a, b):
                context = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with context:
                    # micro-batches step on s * micro + m: a parameter used in an earlier one only is still used
                    (nn.functional.mse_loss(model(x, s * micro + m), y) / micro).backward()
        if clip is not None:
            norms.append(torch.equal(opt.grad_norm, nn.utils.clip_grad_norm_(b.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(norms), f"grad norms equal per step: {norms}"
    assert torch.equal(a.module.never.weight, never)  # the scenario has a parameter unused everywhere


def _scenarios(rank):
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for view in (False, True):
            def run(cls=cls, kwargs=kwargs, view=view):
                a, b = _pair(dict(gradient_as_bucket_view=view, bucket_cap_mb=0.002))
                opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
                ref_opt = cls(b.named_parameters(), **kwargs)
                _train(a, b, opt, ref_opt, rank)
                _check_equal(a, b, opt, ref_opt)

            yield f"{name}/bucket_view={view}", run

    cls, kwargs = OPTIMIZERS["AdamW-fused"]

    def static_graph():
        a, b = _pair(dict(static_graph=True, bucket_cap_mb=0.002))
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank, steps=4)
        _check_equal(a, b, opt, ref_opt)

    def default_buckets():
        a, b = _pair({})
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank)
        _check_equal(a, b, opt, ref_opt)

    def no_sync_accumulation():
        a, b = _pair(dict(bucket_cap_mb=0.002))
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank, micro=3)
        _check_equal(a, b, opt, ref_opt)

    def ignored_parameters():  # DDP does not reduce them: both loops step them on the local gradient
        a, b = _pair(dict(bucket_cap_mb=0.002), ignore=["head.weight", "head.bias"])
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank)
        _check_equal(a, b, opt, ref_opt)
        heads = [torch.empty_like(a.module.head.weight) for _ in range(2)]
        dist.all_gather(heads, a.module.head.weight.detach())
        assert not torch.equal(heads[0], heads[1])  # local steps, as DDP's standard loop does

    def compression_hook():
        a, b = _pair(dict(bucket_cap_mb=0.002))
        b.register_comm_hook(None, fp16_compress_hook)
        opt = dist_optim.InBackwardOptimizer(a, cls, ddp_comm_hook=fp16_compress_hook, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank)
        _check_equal(a, b, opt, ref_opt)

    def exact_clipping():
        a, b = _pair(dict(bucket_cap_mb=0.002))
        opt = dist_optim.InBackwardOptimizer(a, cls, max_grad_norm=0.05, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train(a, b, opt, ref_opt, rank, clip=0.05)
        _check_equal(a, b, opt, ref_opt)

    def refusals():
        a, _ = _pair({})
        with pytest.raises(NotImplementedError, match="accumulation_steps > 1 with DDP.*no_sync"):
            dist_optim.InBackwardOptimizer(a, cls, accumulation_steps=2, **kwargs)
        with pytest.raises(RuntimeError, match="Pass the DDP-wrapped model itself"):
            dist_optim.InBackwardOptimizer(a.parameters(), cls, **kwargs)
        with pytest.raises(RuntimeError, match="un-reduced gradient"):  # the seed function, before wrapping
            dist_optim.apply_optimizer_in_backward(cls, make_model().parameters(), {"lr": 0.1})
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        with pytest.raises(RuntimeError, match="accumulate with `with model.no_sync\\(\\):`"):
            with opt.no_step():
                loss_of(a, batches(1, width=16)[0]).backward()
        with pytest.raises(NotImplementedError, match="cannot detach from a DistributedDataParallel model"):
            opt.remove()

    for name in ("AdamW-fused", "SGD-momentum", "Adam-foreach"):
        for view in (False, True):
            def unused(cls=OPTIMIZERS[name][0], kwargs=OPTIMIZERS[name][1], view=view):
                a, b = _unused_pair(find_unused_parameters=True, gradient_as_bucket_view=view)
                opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
                ref_opt = cls(b.named_parameters(), **kwargs)
                _train_unused(a, b, opt, ref_opt, rank)
                _check_equal(a, b, opt, ref_opt)

            yield f"find_unused/{name}/bucket_view={view}", unused

    for find_unused in (False, True):
        def unused_static(find_unused=find_unused):
            a, b = _unused_pair(static=True, static_graph=True, find_unused_parameters=find_unused)
            opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
            ref_opt = cls(b.named_parameters(), **kwargs)
            _train_unused(a, b, opt, ref_opt, rank)
            _check_equal(a, b, opt, ref_opt)

        yield f"static_graph/find_unused={find_unused}/unused_parameters", unused_static

    def unused_no_sync():
        a, b = _unused_pair(find_unused_parameters=True)
        opt = dist_optim.InBackwardOptimizer(a, cls, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train_unused(a, b, opt, ref_opt, rank, steps=3, micro=2)
        _check_equal(a, b, opt, ref_opt)

    def unused_clipping():
        a, b = _unused_pair(find_unused_parameters=True)
        opt = dist_optim.InBackwardOptimizer(a, cls, max_grad_norm=0.05, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train_unused(a, b, opt, ref_opt, rank, clip=0.05)
        _check_equal(a, b, opt, ref_opt)

    def unused_compression():  # the hook's result is a new tensor, copied into DDP's bucket before the step
        a, b = _unused_pair(find_unused_parameters=True, gradient_as_bucket_view=True)
        b.register_comm_hook(None, fp16_compress_hook)
        opt = dist_optim.InBackwardOptimizer(a, cls, ddp_comm_hook=fp16_compress_hook, **kwargs)
        ref_opt = cls(b.named_parameters(), **kwargs)
        _train_unused(a, b, opt, ref_opt, rank)
        _check_equal(a, b, opt, ref_opt)

    yield "find_unused/no_sync_accumulation", unused_no_sync
    yield "find_unused/fp16_compress_hook", unused_compression
    yield "find_unused/exact_clipping", unused_clipping
    yield "static_graph", static_graph
    yield "default_buckets", default_buckets
    yield "no_sync_accumulation", no_sync_accumulation
    yield "ignored_parameters", ignored_parameters
    yield "fp16_compress_hook", compression_hook
    yield "exact_clipping", exact_clipping
    yield "refusals", refusals


FOUR_RANK_SCENARIOS = {
    "AdamW-fused/bucket_view=False",
    "SGD-momentum/bucket_view=True",
    "no_sync_accumulation",
    "find_unused/AdamW-fused/bucket_view=True",
    "find_unused/SGD-momentum/bucket_view=False",
}


def _worker(rank: int, world: int, store_path: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    failures = []
    try:
        for name, run in _scenarios(rank):
            if world == 4 and name not in FOUR_RANK_SCENARIOS:
                continue
            try:
                run()
            except Exception:  # collect, so that one failure does not hide the others
                failures.append(f"{name}: {traceback.format_exc(limit=3)}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_equals_the_standard_loop(tmp_path, world):
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    failures = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    assert not any(failures), "failed DDP scenarios (name: traceback):\n" + "\n".join(failures)


def test_refuses_a_torch_without_the_used_map():
    from types import SimpleNamespace

    from dist_optim._ddp import check_ddp

    ddp = SimpleNamespace(find_unused_parameters=True, static_graph=False, reducer=object())
    with pytest.raises(NotImplementedError, match="no DDP reducer._get_local_used_map"):
        check_ddp(ddp)
    check_ddp(SimpleNamespace(find_unused_parameters=False, static_graph=False, reducer=object()))

"""Checkpoints across world sizes and wrappers, with real gloo process groups and real DCP files.

Two runs that never stop are the references: FSDP2 on 2 ranks and DDP on 2 ranks (and a single process), each
saving a checkpoint half-way. Every resume pair then loads one of those checkpoints, finishes the run and is
compared with the reference that wrote it: bitwise where the arithmetic is the same (same wrapper, same world
size), else within a tight tolerance (a different world size changes the reduction order of the gradient mean).
Each scenario is its own test, run by the session's group of ranks (tests/dist_runner.py); the references are a
module fixture, so ``pytest -k "test_checkpoint_dist and 4-ranks"`` runs alone.
"""

from __future__ import annotations

import copy
import os
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_runner import RankDied, run_fresh
from helpers import ADAMW, WIDTH, make_model
from helpers import RESHARD_TOLERANCE as TOLERANCE
from torch import nn

import dist_optim
from dist_optim.checkpoint import CheckpointManager, load, save

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

ROWS = 12  # global batch: divisible by 1, 2, 3 and 4 ranks
HALF = 3


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 1, generator=g)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    n = ROWS // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def setup(wrapper: str, mode: str, seed: int = 0):
    """A model (wrapped), its optimizer ('in_backward' or 'standard', same fused AdamW) and a cosine schedule."""
    model = make_model(seed, width=WIDTH)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    if mode == "in_backward":
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * HALF)
    return model, opt, sched


def train(model, opt, sched, mode: str, steps: range) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    for step in steps:
        x, y = local_batch(step, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        if mode == "standard":
            opt.step()
            opt.zero_grad()
        sched.step()


def full_params(model) -> dict[str, torch.Tensor]:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {}
    for name, p in module.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def compare(got: dict, reference_file: Path, exact: bool) -> None:
    want = torch.load(reference_file, weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), f"{name}: max |diff| {(got[name] - want[name]).abs().max()}"
        else:
            torch.testing.assert_close(got[name], want[name], **TOLERANCE, msg=lambda m: f"{name}: {m}")


def uninterrupted(wrapper: str, tmp: Path) -> None:
    """The reference: trains 2*HALF steps, saving at HALF; rank 0 writes the final parameters."""
    model, opt, sched = setup(wrapper, "in_backward")
    train(model, opt, sched, "in_backward", range(HALF))
    CheckpointManager(tmp / f"ck_{wrapper}").save(HALF, model=model, optimizer=opt, schedulers=sched)
    train(model, opt, sched, "in_backward", range(HALF, 2 * HALF))
    params = full_params(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(params, tmp / f"ref_{wrapper}.pt")


def resume(source: str, wrapper: str, mode: str, tmp: Path, exact: bool) -> None:
    """Loads ``ck_<source>`` into a fresh ``wrapper`` model (other initial weights), finishes, compares."""
    model, opt, sched = setup(wrapper, mode, seed=99)
    result = CheckpointManager(tmp / f"ck_{source}").load("latest", model=model, optimizer=opt, schedulers=sched)
    assert result is not None and result.step == HALF
    train(model, opt, sched, mode, range(HALF, 2 * HALF))
    compare(full_params(model), tmp / f"ref_{source}.pt", exact)


def async_save_snapshot(tmp: Path) -> None:
    """FSDP2: training goes on while the async upload writes; the checkpoint holds the state at save() time."""
    model, opt, sched = setup("fsdp2", "in_backward")
    train(model, opt, sched, "in_backward", range(2))
    manager = CheckpointManager(tmp / "ck_async", async_save=True)
    manager.save(2, model=model, optimizer=opt, schedulers=sched)
    expected = full_params(model)
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in opt.state_dict()["state"].items()}
    train(model, opt, sched, "in_backward", range(2, 4))  # in-backward steps while the save may be in flight
    manager.wait()
    model2, opt2, sched2 = setup("fsdp2", "in_backward", seed=5)
    manager.load("latest", model=model2, optimizer=opt2, schedulers=sched2)
    got = full_params(model2)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert all(torch.equal(opt2.state_dict()["state"][k]["exp_avg"].full_tensor(), v) for k, v in exp_avg.items())


def previous_norm_resume(tmp: Path) -> None:
    """FSDP2, clip_mode="previous_norm": the norm (a DTensor) carried by the checkpoint clips the next step."""
    def make(seed=0):
        model, _, _ = setup("fsdp2", "standard", seed)  # the model only; the optimizer is built below
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, max_grad_norm=0.05, clip_mode="previous_norm",
                                             **ADAMW)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    ref = make()
    train(*ref, "in_backward", range(2 * HALF))
    first = make()
    train(*first, "in_backward", range(HALF))
    save(tmp / "ck_prev", model=first[0], optimizer=first[1])
    second = make(seed=9)
    load(tmp / "ck_prev", model=second[0], optimizer=second[1])
    train(*second, "in_backward", range(HALF, 2 * HALF))
    got, want = full_params(second[0]), full_params(ref[0])
    assert all(torch.equal(got[k], want[k]) for k in want), "resumed run differs from the uninterrupted one"


def rng_saved(tmp: Path) -> None:
    """Each rank's torch and Python generators are saved; the next draws are recorded per rank."""
    import random

    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    random.seed(10 + rank)
    model = make_model(width=WIDTH)
    save(tmp / "ck_rng", model=model)
    torch.save({"torch": torch.rand(4), "python": torch.tensor(random.random(), dtype=torch.float64)},
               tmp / f"rng_{rank}.pt")


def rng_restored(tmp: Path) -> None:
    """Rank r of any world size gets saved rank r % 2's generators back."""
    import random

    rank = dist.get_rank()
    torch.manual_seed(0)
    random.seed(0)
    load(tmp / "ck_rng", model=make_model(width=WIDTH))
    want = torch.load(tmp / f"rng_{rank % 2}.pt", weights_only=True)
    assert torch.equal(torch.rand(4), want["torch"])
    assert random.random() == want["python"].item()


PHASES = {
    # world 2: the references, resume in the same setting (bitwise), and a single-process checkpoint on 2 ranks
    2: {
        "fsdp2 uninterrupted": lambda tmp: uninterrupted("fsdp2", tmp),
        "ddp uninterrupted": lambda tmp: uninterrupted("ddp", tmp),
        "fsdp2 -> fsdp2 (2 ranks, bitwise)": lambda tmp: resume("fsdp2", "fsdp2", "in_backward", tmp, exact=True),
        "fsdp2 -> fsdp2 standard optimizer (2 ranks, bitwise)":
            lambda tmp: resume("fsdp2", "fsdp2", "standard", tmp, exact=True),
        "ddp -> ddp (2 ranks, bitwise)": lambda tmp: resume("ddp", "ddp", "in_backward", tmp, exact=True),
        "ddp -> fsdp2 (2 ranks)": lambda tmp: resume("ddp", "fsdp2", "in_backward", tmp, exact=False),
        "plain -> fsdp2 (2 ranks)": lambda tmp: resume("plain", "fsdp2", "in_backward", tmp, exact=False),
        "plain -> ddp standard optimizer (2 ranks)": lambda tmp: resume("plain", "ddp", "standard", tmp, exact=False),
        "async save under fsdp2": async_save_snapshot,
        "fsdp2 previous_norm clipping resume (bitwise)": previous_norm_resume,
        "rng states saved per rank": rng_saved,
        "rng states restored per rank (2 ranks)": rng_restored,
    },
    3: {
        "fsdp2 -> fsdp2 (3 ranks)": lambda tmp: resume("fsdp2", "fsdp2", "in_backward", tmp, exact=False),
        "ddp -> fsdp2 standard optimizer (3 ranks)": lambda tmp: resume("ddp", "fsdp2", "standard", tmp, exact=False),
    },
    4: {
        "fsdp2 -> fsdp2 (4 ranks)": lambda tmp: resume("fsdp2", "fsdp2", "in_backward", tmp, exact=False),
        "fsdp2 -> ddp (4 ranks)": lambda tmp: resume("fsdp2", "ddp", "in_backward", tmp, exact=False),
        "rng states restored per rank (4 ranks)": rng_restored,
    },
}


# run before every resume: the checkpoints and final parameters they load and compare with
REFERENCES = ("fsdp2 uninterrupted", "ddp uninterrupted", "rng states saved per rank")
SINGLE_PROCESS = {
    "fsdp2 -> plain (1 process)": lambda tmp: resume("fsdp2", "plain", "in_backward", tmp, exact=False),
    "ddp -> plain standard optimizer (1 process)": lambda tmp: resume("ddp", "plain", "standard", tmp, exact=False),
}


def _phase(ctx, world: int, name: str, tmp: str) -> None:
    PHASES[world][name](Path(tmp))


@pytest.fixture(scope="module")
def references(ranks, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("checkpoints")
    uninterrupted("plain", tmp)
    for name in REFERENCES:
        ranks.run(2, _phase, world=2, name=name, tmp=str(tmp))
    return tmp


RESUMES = [
    pytest.param(world, name, id=re.sub(r"\W+", "-", name.replace("->", "to")).strip("-"))
    for world, names in [(1, SINGLE_PROCESS), *PHASES.items()]
    for name in names if name not in REFERENCES
]


@pytest.mark.parametrize("world, name", RESUMES)
def test_resume_across_world_sizes_wrappers_and_optimizer_kinds(ranks, references, world, name):
    if world == 1:
        SINGLE_PROCESS[name](references)
    else:
        ranks.run(world, _phase, world=world, name=name, tmp=str(references))


# -- a rank killed while a checkpoint is being written ---------------------------------------------------------------
def _crashing_worker(ctx, tmp: str) -> None:
    rank = ctx.rank
    model, opt, sched = setup("fsdp2", "in_backward")
    manager = CheckpointManager(Path(tmp) / "ck", keep_last=1)
    train(model, opt, sched, "in_backward", range(2))
    manager.save(2, model=model, optimizer=opt, schedulers=sched)
    params = full_params(model)
    if rank == 0:
        torch.save(params, Path(tmp) / "ref.pt")
    train(model, opt, sched, "in_backward", range(2, 3))
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        def die(self, plan, planner):  # the kill lands in the middle of writing this rank's shard
            (Path(self.path) / "__1_0.distcp").write_bytes(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = die
    dist.barrier()
    manager.save(3, model=model, optimizer=opt, schedulers=sched)  # rank 1 dies; rank 0 never gets to commit


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankDied, match="rank 1: killed by signal SIGKILL"):
        run_fresh(2, _crashing_worker, tmp=str(tmp_path))  # a group of its own: it patches FileSystemWriter
    assert (tmp_path / "ck" / "step_00000003.partial").is_dir()
    manager = CheckpointManager(tmp_path / "ck", keep_last=1)
    assert manager.latest() == tmp_path / "ck" / "step_00000002"
    model, opt, sched = setup("plain", "in_backward", seed=7)
    result = manager.load("latest", model=model, optimizer=opt, schedulers=sched)
    assert result.step == 2
    compare(full_params(model), tmp_path / "ref.pt", exact=True)
    # the next save of the restarted job replaces the unfinished folder
    train(model, opt, sched, "in_backward", range(2, 3))
    manager.save(3, model=model, optimizer=opt, schedulers=sched)
    assert [p.name for p in manager.checkpoints()] == ["step_00000003"]
    assert not (tmp_path / "ck" / "step_00000003.partial").exists()
    model2 = copy.deepcopy(model)
    load(tmp_path / "ck" / "step_00000003", model=model2)


def test_save_refuses_an_optimizer_that_trains_another_model(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(make_model().parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .* is not a parameter of the model"):
        save(tmp_path / "ck", model=model, optimizer=opt)
    assert not (tmp_path / "ck.partial").exists() and not (tmp_path / "ck").exists()


# -- two jobs saving the same checkpoint name at the same time -------------------------------------------------------
def _wait_for(path: Path) -> None:
    import time

    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _paused_save(tmp_path: Path, name: str, value: float, go: str) -> None:
    """One single-process job: writes its shard, waits for the file ``go``, then finishes and commits."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_then_wait(self, plan, planner):
        written = original(self, plan, planner)
        written.wait()
        (tmp_path / f"{name}.written").touch()
        _wait_for(tmp_path / go)
        return written

    FileSystemWriter.write_data = write_then_wait
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(value)
    try:
        save(tmp_path / "ck", model=model)
        outcome = "saved"
    except BaseException as e:  # DCP's CheckpointException is one: report it like any other failure
        outcome = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = original  # the rank runs other scenarios after this one
    (tmp_path / f"{name}.result").write_text(outcome)


def _two_jobs(ctx, tmp: str) -> None:
    """Rank 0 runs the first job and rank 1 the second, with no process group: two single-process jobs. The second
    stages while the first is between its write and its commit, and commits after the first has."""
    tmp_path = Path(tmp)
    if ctx.rank == 0:
        _paused_save(tmp_path, "first", 1.0, go="second.written")
    else:
        _wait_for(tmp_path / "first.written")
        _paused_save(tmp_path, "second", 2.0, go="first.result")


def test_a_second_job_saving_the_same_name_never_breaks_the_first(ranks, tmp_path):
    ranks.run_before_group(2, _two_jobs, tmp=str(tmp_path))
    outcomes = {n: (tmp_path / f"{n}.result").read_text() for n in ("first", "second")}
    assert outcomes["first"] == "saved", outcomes
    model = nn.Linear(4, 4)
    load(tmp_path / "ck", model=model)
    assert torch.equal(model.weight, torch.full((4, 4), 1.0)), "the first job's checkpoint holds other weights"
    # the second job could not commit a name that exists; it says so with our error, not DCP's BaseException
    assert outcomes["second"].startswith("CheckpointError: saving") and "another save committed" in outcomes["second"]
    assert not (tmp_path / "ck.partial").exists()


# -- a save after a backward that raised on one rank only ------------------------------------------------------------
def _incomplete_on_one_rank(ctx, tmp: str) -> None:
    from dist_optim.checkpoint import CheckpointError

    # plain modules stepped on local gradients: no collective in backward, so rank 0 alone can fail in its backward
    model = make_model(width=WIDTH)
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, per_parameter=True, allow_local_steps=True,
                                         **ADAMW)
    x, y = local_batch(0, ctx.rank, ctx.world)
    def boom(grad):
        raise RuntimeError("boom on rank 0")

    h = torch.tanh(model.layers[0](x))
    if ctx.rank == 0:
        h.register_hook(boom)  # raises after the layers above it were stepped
    out = model.head(model.norm(torch.tanh(model.layers[2](torch.tanh(model.layers[1](h))))))
    if ctx.rank == 0:
        with pytest.raises(RuntimeError, match="boom on rank 0"):
            nn.functional.mse_loss(out, y).backward()
    else:
        nn.functional.mse_loss(out, y).backward()
    assert opt.step_incomplete == (ctx.rank == 0) and opt.last_step.params_stepped > 0
    folder = Path(tmp) / "refused"
    with pytest.raises(CheckpointError, match=r"in-backward step is incomplete on ranks \[0\] .*force=True"):
        save(folder, model=model, optimizer=opt)
    manager = CheckpointManager(Path(tmp) / "managed")
    with pytest.raises(CheckpointError, match=r"incomplete on ranks \[0\]"):
        manager.save(1, model=model, optimizer=opt)
    dist.barrier()
    assert not folder.exists() and not folder.with_name("refused.partial").exists()
    assert manager.checkpoints() == [] and not list((Path(tmp) / "managed").glob("*"))


def test_an_incomplete_step_on_one_rank_is_refused_on_every_rank(ranks, tmp_path):
    ranks.run(2, _incomplete_on_one_rank, tmp=str(tmp_path))
    assert sorted(p.name for p in tmp_path.rglob("*")) in ([], ["managed"])  # nothing written

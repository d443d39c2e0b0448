"""Low-bit optimizer states through dist_optim.checkpoint (issue 23, item 4): torchao's quantised states (tensor
subclasses: codes, block scales, a lookup table) and bitsandbytes' 8-bit states (plain uint8 codes in its own
nested format), with real DCP files and real gloo ranks.

Every resume is compared with the run that never stopped. Under DDP and FSDP2 every rank gets the same batch
here, so the gradient mean over 2 ranks is the gradient itself (g/2 + g/2 = g in floating point): one process and 2
ranks then run the same arithmetic, and a checkpoint carried between them must give bitwise the uninterrupted run.
Under FSDP2 each rank quantised its own shard; where the shards' blocks start where the whole parameter's do, the
states are cut and joined between layouts (2 -> 1, 1 -> 2, 2 -> 4 FSDP2 ranks; compared also with torchao's own
loop loaded the same way), and elsewhere refused, naming the sizes.

torchao's step runs eagerly in every test here (``helpers.eager_compile``, on both sides of every comparison): the
checkpoint is what is under test, and eagerly the same code runs. Compiled, each parameter shape compiles anew
(about 5 CPU-s each on a cold inductor cache: the first run on a machine, CI's every run), and under FSDP2 the step
compiled for a rank's empty shard kills the rank with SIGSEGV when inductor loads it from its on-disk cache
(docs/optimizers.md). tests/test_torchao_step.py holds the compiled step.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import eager_compile, eagerly
from torch import nn

import dist_optim
from dist_optim.checkpoint import CheckpointError, load, save

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

# bitsandbytes keeps tensors below min_8bit_size (4096 elements) in 32 bits; these weights have 8192 elements
CLASSES = {"torchao.optim.AdamW8bit": {}, "torchao.optim.AdamW4bit": {}, "torchao.optim.AdamWFp8": {},
           "bitsandbytes.optim.Adam8bit": {}}
HALF = 2  # steps before the checkpoint, and after it
LR = 1e-2


def _class(path: str):
    module, _, name = path.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(pytest.importorskip(module), name)


def _model(seed: int = 0, shapes: str = "base") -> nn.Module:
    """``"base"``: weights of 8192, 131072 and 7936 elements, quantised by both packages in one process (at least 4096
    elements, a multiple of the block size). On 2 FSDP2 ranks the (31, 256) weight is cut into 16 and 15 rows: 4096
    elements, quantised, and 3840, plain (torchao quantises a shard of at least 4096 elements): a state quantised on
    one rank only. ``"misaligned"`` adds a (256, 31) weight, quantised whole and cut into two plain shards of 3968
    elements on 2 ranks. ``"aligned"``: weights of 16384, 65536 and 16384 elements, whose shards on 2 and 4 ranks are
    all quantised, in blocks that start where the whole weight's do."""
    torch.manual_seed(seed)
    if shapes == "aligned":
        return nn.Sequential(nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 64), nn.Tanh(), nn.Linear(64, 256),
                             nn.Tanh(), nn.Linear(256, 1))
    back = [nn.Linear(31, 256), nn.Tanh(), nn.Linear(256, 1)] if shapes == "misaligned" else [nn.Linear(31, 1)]
    return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 31),
                         nn.Tanh(), *back)


def _wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def _build(path: str, wrapper: str, seed: int = 0, shapes: str = "base"):
    model = _wrap(_model(seed, shapes), wrapper)
    opt = dist_optim.InBackwardOptimizer(model, _class(path), lr=LR, **CLASSES[path])
    return model, opt


def _train(model: nn.Module, steps: range) -> None:
    for step in steps:  # the same batch on every rank (see the module's docstring)
        g = torch.Generator().manual_seed(100 + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()


def _params(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters (an FSDP2 shard gathered: collective)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _local(v):
    return v.to_local() if hasattr(v, "to_local") else v


def _states(opt) -> list[dict]:
    """Each parameter's state, in the order of the param groups (``opt.state`` is in the order steps created it)."""
    return [opt.state.get(p, {}) for g in opt.param_groups for p in g["params"]]


def _state_types(opt) -> list[str]:
    return [f"{k}:{type(_local(v)).__name__}" for s in _states(opt) for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)]


def _same_state(a, b) -> None:
    """Bitwise equal states, the subclasses' inner tensors (codes, scales, lookup table) compared one by one."""
    for sa, sb in zip(_states(a), _states(b), strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            x, y = _local(sa[k]), _local(sb[k])
            if not isinstance(x, torch.Tensor):
                assert x == y, k
                continue
            assert type(x) is type(y), f"{k}: {type(x).__name__} loaded back as {type(y).__name__}"
            if hasattr(type(x), "__tensor_flatten__"):
                names, attrs = x.__tensor_flatten__()
                assert attrs == y.__tensor_flatten__()[1], k
                pairs = [(getattr(x, n), getattr(y, n)) for n in names]
            else:
                pairs = [(x, y)]
            for u, v in pairs:  # compared as bytes, whatever the dtype (fp8 codes, a NaN)
                bits = (t.reshape(-1).view(torch.uint8) for t in (u, v))
                assert u.dtype == v.dtype and torch.equal(*bits), k


@pytest.fixture(autouse=True)
def _eager_steps():
    """torchao's step run eagerly in this process's tests (the module's docstring; ranks: ``eagerly``)."""
    with eager_compile():
        yield


def _own_loop_runs(path: str) -> None:
    """Skip a class whose own standard loop cannot run on this machine."""
    model = _model()
    opt = _class(path)(model.parameters(), lr=LR, **CLASSES[path])
    try:
        model(torch.randn(2, 16)).square().mean().backward()
        opt.step()
    except Exception as e:  # noqa: BLE001 - the class's own loop fails here: nothing of ours to compare
        pytest.skip(f"{path}'s own loop fails here: {type(e).__name__}: {str(e)[:200]}")


def _quantised(types: list[str]) -> bool:
    return any("OptimState" in t for t in types) or any(t.startswith("state1:") for t in types)


# -- one process -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(CLASSES))
def test_one_process_resume_is_bitwise(path, tmp_path):
    """Save after 2 steps, load into a fresh optimizer (other initial weights), 2 more steps: bitwise the run that
    never stopped; the loaded states are the saved classes (torchao's subclasses, not plain tensors)."""
    _own_loop_runs(path)
    model, opt = _build(path, "plain")
    _train(model, range(HALF))
    save(tmp_path / "ck", model=model, optimizer=opt)
    saved_types = _state_types(opt)
    assert _quantised(saved_types), saved_types  # the quantised path, not the 32-bit one small tensors take
    resumed, again = _build(path, "plain", seed=9)
    load(tmp_path / "ck", model=resumed, optimizer=again)
    assert _state_types(again) == saved_types
    _same_state(opt, again)
    _train(model, range(HALF, 2 * HALF))
    _train(resumed, range(HALF, 2 * HALF))
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(resumed), strict=True))
    _same_state(opt, again)


def test_standard_and_in_backward_checkpoints_load_into_each_other(tmp_path):
    """torchao's AdamW8bit in its own loop -> in backward, and back: the same subclass states, bitwise."""
    path = "torchao.optim.AdamW8bit"
    _own_loop_runs(path)
    model = _model()
    opt = _class(path)(model.parameters(), lr=LR)
    for step in range(HALF):
        g = torch.Generator().manual_seed(100 + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    save(tmp_path / "ck", model=model, optimizer=opt)
    resumed, again = _build(path, "plain", seed=9)
    load(tmp_path / "ck", model=resumed, optimizer=again)
    assert _state_types(again) == _state_types(opt)
    _same_state(opt, again)
    save(tmp_path / "ck_in_backward", model=resumed, optimizer=again)
    standard = _model(seed=5)
    back = _class(path)(standard.parameters(), lr=LR)
    load(tmp_path / "ck_in_backward", model=standard, optimizer=back)
    assert _state_types(back) == _state_types(opt)
    _same_state(opt, back)


def test_an_async_save_holds_the_quantised_state_of_save_time(tmp_path):
    """The inner tensors are copied before save(async_save=True) returns: steps taken while the upload runs
    change the optimizer's codes and scales, not the checkpoint's."""
    path = "torchao.optim.AdamW8bit"
    _own_loop_runs(path)
    model, opt = _build(path, "plain")
    _train(model, range(HALF))
    pending = save(tmp_path / "ck", model=model, optimizer=opt, async_save=True)
    at_save = _build(path, "plain", seed=9)
    # the state at save time, through torch.save (which keeps the subclasses)
    torch.save(opt.state_dict(), tmp_path / "at_save.pt")
    _train(model, range(HALF, 2 * HALF))
    pending.wait()
    at_save[1].load_state_dict(torch.load(tmp_path / "at_save.pt", weights_only=False))
    resumed, again = _build(path, "plain", seed=9)
    load(tmp_path / "ck", model=resumed, optimizer=again)
    _same_state(at_save[1], again)


# -- DDP: 2 ranks <-> 1 process ----------------------------------------------------------------------------------------
DDP_CLASSES = ["torchao.optim.AdamW8bit", "torchao.optim.AdamWFp8", "bitsandbytes.optim.Adam8bit"]


def _inner(v) -> dict[str, torch.Tensor]:
    """A state's data as plain tensors: a torchao state's codes, scale (and lookup table), else the tensor."""
    v = _local(v)
    if hasattr(type(v), "__tensor_flatten__"):
        return {n: getattr(v, n).detach().clone() for n in v.__tensor_flatten__()[0]}
    return {"plain": v.detach().clone()}


def _data(opt) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each parameter's state tensors but ``step``, as :func:`_inner` (this rank's shard under FSDP2)."""
    return [{k: _inner(v) for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step"} for s in _states(opt)]


@eagerly
def _uninterrupted(ctx, path: str, wrapper: str, tmp: str, shapes: str = "base") -> list[str]:
    """Train 2*HALF steps, saving at HALF (each rank also writes its states of that moment as plain tensors);
    rank 0 writes the final parameters."""
    model, opt = _build(path, wrapper, shapes=shapes)
    _train(model, range(HALF))
    save(Path(tmp) / f"ck_{wrapper}", model=model, optimizer=opt)
    torch.save(_data(opt), Path(tmp) / f"state_{wrapper}_rank{ctx.rank if ctx else 0}.pt")
    types = _state_types(opt)
    _train(model, range(HALF, 2 * HALF))
    params = _params(model)
    if ctx is None or ctx.rank == 0:
        torch.save(params, Path(tmp) / f"ref_{wrapper}.pt")
    return types


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bytes, whatever the dtype (fp8 codes, a NaN)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _holds_slices_of(opt, whole: list[dict[str, dict[str, torch.Tensor]]], rank: int, world: int) -> None:
    """This rank's state shards are the saved whole states' elements of its shard (FSDP2's ``torch.chunk`` of dim
    0): codes and block scales cut where the shard starts, not re-quantised."""
    for p, mine, saved in zip([p for g in opt.param_groups for p in g["params"]], _data(opt), whole, strict=True):
        rows = -(-p.shape[0] // world)
        start = min(rank * rows, p.shape[0]) * (p.numel() // p.shape[0])
        n = _local(p).numel()
        for k, inner in mine.items():
            if n == 0:  # an empty shard (the last rank's of a 1-row bias)
                assert all(t.numel() == 0 for t in inner.values()), k
                continue
            assert inner.keys() == saved[k].keys(), (k, list(inner), list(saved[k]))
            for name, t in inner.items():
                if name == "qmap":
                    assert _same_bytes(t, saved[k][name]), k
                    continue
                per = n // t.numel()  # elements per entry: 1, 2 (4-bit codes), or a block (scales)
                assert _same_bytes(t, saved[k][name].reshape(-1)[start // per:(start + n) // per]), (k, name)


@eagerly
def _resume(ctx, path: str, wrapper: str, source: str, tmp: str, shapes: str = "base") -> list[str]:
    """Load ``ck_<source>`` into a fresh ``wrapper`` model (other initial weights), finish, compare bitwise. From a
    one-process checkpoint into FSDP2: each shard's state is first checked against the saved whole."""
    model, opt = _build(path, wrapper, seed=9, shapes=shapes)
    load(Path(tmp) / f"ck_{source}", model=model, optimizer=opt)
    if wrapper == "fsdp2" and source == "plain":
        whole = torch.load(Path(tmp) / "state_plain_rank0.pt", weights_only=True)
        _holds_slices_of(opt, whole, ctx.rank, ctx.world)
    types = _state_types(opt)
    _train(model, range(HALF, 2 * HALF))
    want = torch.load(Path(tmp) / f"ref_{source}.pt", weights_only=True)
    got = _params(model)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {k}: max |diff| {(a - b).abs().max()}"
    return types


@pytest.mark.parametrize("path", DDP_CLASSES)
def test_ddp_2_ranks_resume_on_1_process_bitwise(ranks, path, tmp_path):
    _own_loop_runs(path)
    saved = ranks.run(2, _uninterrupted, path=path, wrapper="ddp", tmp=str(tmp_path))
    assert saved[0] == saved[1] and _quantised(saved[0]), saved
    assert _resume(None, path, "plain", source="ddp", tmp=str(tmp_path)) == saved[0]


@pytest.mark.parametrize("path", DDP_CLASSES)
def test_1_process_resumes_on_ddp_2_ranks_bitwise(ranks, path, tmp_path):
    _own_loop_runs(path)
    saved = _uninterrupted(None, path, "plain", tmp=str(tmp_path))
    assert _quantised(saved), saved
    assert ranks.run(2, _resume, path=path, source="plain", wrapper="ddp", tmp=str(tmp_path)) == [saved, saved]


# -- FSDP2: shards cut and joined at block boundaries, or refused --------------------------------------------------
FSDP2_CLASS = "torchao.optim.AdamW8bit"
RESHARD_CLASSES = ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit"]


def _train_standard(model: nn.Module, opt, steps: range) -> None:
    """The standard loop on :func:`_train`'s batches."""
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _joined(tmp: Path, wrapper: str, world: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """The states each rank held at save time, joined in rank order: flat codes and scales one after the other,
    the lookup table of rank 0."""
    per_rank = [torch.load(tmp / f"state_{wrapper}_rank{r}.pt", weights_only=True) for r in range(world)]
    out = []
    for states in zip(*per_rank, strict=True):
        out.append({k: {n: states[0][k][n] if n == "qmap" else torch.cat([s[k][n].reshape(-1) for s in states])
                        for n in states[0][k]} for k in states[0]})
    return out


@eagerly
def _resume_beside_own_loop(ctx, path: str, wrapper: str, saved_by: str, saved_world: int, tmp: str,
                            uninterrupted: bool) -> list[str]:
    """Load ``ck_<saved_by>`` (written by ``saved_world`` ranks) into the in-backward optimizer and into torchao's
    own, each on a fresh ``wrapper`` model; both hold each saved state's codes and scales (or plain values) from
    where this rank's piece starts, quantised where torchao's own optimizer quantises. Then both train on, the
    standard loop for torchao's: bitwise equal, and, with ``uninterrupted``, equal to the run that never stopped."""
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    saved = _joined(Path(tmp), saved_by, saved_world)
    model, opt = _build(path, wrapper, seed=9, shapes="aligned")
    load(Path(tmp) / f"ck_{saved_by}", model=model, optimizer=opt)
    standard = _wrap(_model(seed=5, shapes="aligned"), wrapper)
    own = _class(path)(standard.parameters(), lr=LR)
    load(Path(tmp) / f"ck_{saved_by}", model=standard, optimizer=own)
    _holds_slices_of(opt, saved, rank, world)
    _holds_slices_of(own, saved, rank, world)
    torchao_would = [f"{k}:{type(_local(own._new_buffer(p, k == 'exp_avg'))).__name__}" if k != "step" else
                     "step:Tensor" for p in standard.parameters() for k in ("exp_avg", "exp_avg_sq", "step")]
    types = _state_types(opt)
    assert types == _state_types(own) == torchao_would, (types, torchao_would)
    _train(model, range(HALF, 2 * HALF))
    _train_standard(standard, own, range(HALF, 2 * HALF))
    want = torch.load(Path(tmp) / f"ref_{saved_by}.pt", weights_only=True) if uninterrupted else None
    for k, (a, b) in enumerate(zip(_params(model), _params(standard), strict=True)):
        assert torch.equal(a, b), f"parameter {k}: in backward vs {path}'s own loop, max |diff| {(a - b).abs().max()}"
        if want is not None:
            diff = (a - want[k]).abs().max()
            assert torch.equal(a, want[k]), f"parameter {k}: resumed vs never stopped, max |diff| {diff}"
    return types


@pytest.mark.parametrize("path", RESHARD_CLASSES)
def test_fsdp2_2_ranks_resume_on_1_process_exactly(ranks, path, tmp_path):
    """FSDP2 on 2 ranks -> one process, every shard quantised in blocks that start where the whole parameter's do:
    the loaded codes and scales are the ranks' joined, bitwise, quantised where torchao's own optimizer quantises.
    Training on equals torchao's own loop loaded from the same checkpoint, and the FSDP2 run that never stopped,
    bitwise (every rank given the same batch, torchao's step run eagerly on every side)."""
    saved = ranks.run(2, _uninterrupted, path=path, wrapper="fsdp2", tmp=str(tmp_path), shapes="aligned")
    assert saved[0] == saved[1] and _quantised(saved[0]), saved
    assert _resume_beside_own_loop(None, path, "plain", saved_by="fsdp2", saved_world=2, tmp=str(tmp_path),
                                   uninterrupted=True) == saved[0]


def test_1_process_resumes_on_fsdp2_2_ranks_exactly(ranks, tmp_path):
    """One process -> FSDP2 on 2 ranks: each rank's shard state is the saved whole's codes and scales from where
    the shard starts (not re-quantised); training on equals torchao's own loop and the one-process run that never
    stopped, bitwise."""
    saved = _uninterrupted(None, FSDP2_CLASS, "plain", tmp=str(tmp_path), shapes="aligned")
    assert _quantised(saved), saved
    assert ranks.run(2, _resume_beside_own_loop, path=FSDP2_CLASS, wrapper="fsdp2", saved_by="plain", saved_world=1,
                     tmp=str(tmp_path), uninterrupted=True) == [saved, saved]


def test_fsdp2_2_ranks_resume_on_fsdp2_4_ranks_exactly(ranks, tmp_path):
    """FSDP2 on 2 ranks -> FSDP2 on 4: each rank's state is a quarter of the saved ranks' joined codes and scales;
    training on equals torchao's own loop loaded the same way, bitwise (not the 2-rank run: 4 gradients are summed
    in another order)."""
    saved = ranks.run(2, _uninterrupted, path=FSDP2_CLASS, wrapper="fsdp2", tmp=str(tmp_path), shapes="aligned")
    assert ranks.run(4, _resume_beside_own_loop, path=FSDP2_CLASS, wrapper="fsdp2", saved_by="fsdp2", saved_world=2,
                     tmp=str(tmp_path), uninterrupted=False) == [saved[0]] * 4


@eagerly
def _refused_elsewhere(ctx, path: str, wrapper: str, tmp: str, shapes: str = "misaligned") -> str:
    """A load whose sharding cannot hold the saved states exactly: refused before the model or optimizer
    changes."""
    model, opt = _build(path, wrapper, seed=9, shapes=shapes)
    before = _params(model)
    with pytest.raises(CheckpointError) as refused:
        load(Path(tmp) / "ck_fsdp2", model=model, optimizer=opt)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
    assert not opt.state
    return str(refused.value)


def test_fsdp2_misaligned_shards_resume_on_their_world_size_only(ranks, tmp_path):
    """With shards torchao treats unlike the whole parameter: 2 FSDP2 ranks -> 2 FSDP2 ranks bitwise, each rank's
    shard back as it was (OptimState8bit beside a plain shard); 2 -> 1 process and 2 FSDP2 -> 2 DDP ranks refused,
    naming the states, their sizes, and the world sizes that would work."""
    saved = ranks.run(2, _uninterrupted, path=FSDP2_CLASS, wrapper="fsdp2", tmp=str(tmp_path), shapes="misaligned")
    assert _quantised(saved[0]) and _quantised(saved[1]), saved
    assert saved[0] != saved[1], saved  # the (31, 256) weight: quantised on rank 0, plain on rank 1 (see _model)
    assert ranks.run(2, _resume, path=FSDP2_CLASS, source="fsdp2", wrapper="fsdp2", tmp=str(tmp_path),
                     shapes="misaligned") == saved
    message = _refused_elsewhere(None, FSDP2_CLASS, "plain", tmp=str(tmp_path))
    assert "4 low-bit optimizer state(s) cannot be loaded exactly on this layout (1 rank(s)); nothing was loaded" \
        in message, message
    assert ("'exp_avg' of 4.weight (OptimState8bit, saved in per-rank shards by 2 rank(s), placements "
            "(Shard(dim=0),)): the whole parameter: torchao quantises (7936 elements: at least 4096, a multiple of "
            "its block size 256) elements [0, 7936), but they hold saved rank 1's shard, elements [4096, 7936) "
            "(plain): filling them would quantise the saved values") in message, message
    assert ("'exp_avg_sq' of 6.weight (saved plain): the whole parameter: torchao quantises (7936 elements: at "
            "least 4096, a multiple of its block size 256) elements [0, 7936), but they hold the saved state "
            "(plain)") in message, message
    assert ("load exactly under FSDP2 (Shard(0), a 1-D mesh) on 2 ranks (world sizes 1 to 8 checked)"
            in message), message
    for m in ranks.run(2, _refused_elsewhere, path=FSDP2_CLASS, wrapper="ddp", tmp=str(tmp_path)):
        assert "cannot be loaded exactly on this layout (2 rank(s))" in m and "the whole parameter: " in m, m


def test_a_whole_state_into_misaligned_fsdp2_shards_is_refused(ranks, tmp_path):
    """One process -> FSDP2 on 2 ranks where a shard would be plain (the (31, 256) and (256, 31) weights): each
    such shard could only be de-quantised: refused, naming it; the one-process layout is the one that works."""
    _uninterrupted(None, FSDP2_CLASS, "plain", tmp=str(tmp_path), shapes="misaligned")
    (tmp_path / "ck_plain").rename(tmp_path / "ck_fsdp2")
    for m in ranks.run(2, _refused_elsewhere, path=FSDP2_CLASS, wrapper="fsdp2", tmp=str(tmp_path)):
        assert ("'exp_avg' of 4.weight (OptimState8bit, saved whole by one process or DDP): rank 1's shard under "
                "FSDP2 on 2 ranks: torchao keeps plain (3840 elements: fewer than 4096) elements [4096, 7936), but "
                "they hold the saved state of the whole parameter (7936 elements, quantised): filling them would "
                "de-quantise the saved values") in m, m
        assert "'exp_avg' of 6.weight (OptimState8bit, saved whole by one process or DDP): rank 0's shard" in m, m
        assert "load exactly unsharded (one process, or DDP on any number of ranks) (world sizes 1 to 8" in m, m


def test_a_state_quantised_in_other_blocks_is_refused(tmp_path):
    """A checkpoint of AdamW8bit's blocks of 256 into AdamW8bit(block_size=128): torchao would quantise in other
    blocks; holding the saved ones is not what it would hold. Refused, naming both sizes."""
    model, opt = _build(FSDP2_CLASS, "plain", shapes="aligned")
    _train(model, range(1))
    save(tmp_path / "ck", model=model, optimizer=opt)
    resumed = _model(seed=9, shapes="aligned")
    other = dist_optim.InBackwardOptimizer(resumed, _class(FSDP2_CLASS), lr=LR, block_size=128)
    before = _params(resumed)
    with pytest.raises(CheckpointError, match=r"quantised in blocks of 256 elements and this optimizer quantises "
                                              r"in blocks of 128: build it with block_size=256"):
        load(tmp_path / "ck", model=resumed, optimizer=other)
    assert not other.state and all(torch.equal(a, b) for a, b in zip(before, _params(resumed), strict=True))


def test_torchao_quantises_as_the_checkpoint_cuts():
    """What the resharding relies on, against torchao itself: its optimizers quantise a local tensor exactly when
    it has at least 4096 elements and a multiple of the block size; and a whole tensor quantised in blocks has,
    cut at a block boundary, the codes and scales of each part quantised on its own (the 4-bit codes two a byte)."""
    from dist_optim.checkpoint import _reshard, _subclass_state

    for path in ("torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit", "torchao.optim.AdamWFp8"):
        cls = _class(path)
        opt = cls([torch.zeros(1, requires_grad=True)], lr=LR)
        for n in (2048, 4095, 4096, 4096 + 64, 4096 + 128, 4096 + 256, 8192):
            made = opt._new_buffer(torch.zeros(n), True)
            assert hasattr(type(made), "__tensor_flatten__") == _reshard.quantises(n, opt.block_size), (path, n)
        torch.manual_seed(0)
        x = torch.randn(64, 128)
        for signed in (True, False):
            def quantised(t, signed=signed, cls=cls, block=opt.block_size):
                return cls._subclass_zeros(t, signed, block).copy_(t if signed else t.abs())

            whole = quantised(x)
            desc, inner = _subclass_state.flatten(whole, "x")
            assert _subclass_state.PACKINGS[desc["class"]].shared == tuple(n for n in inner if n not in
                                                                           ("codes", "scale"))
            parts = [(x[:32], 0, 4096), (x[32:], 4096, 8192)]
            for part, first, last in parts:
                cut = _subclass_state.join(desc, [(inner, first, last)], opt.block_size, tuple(part.shape), "x")
                _same_state_tensor(cut, quantised(part))
            pieces = [_subclass_state.flatten(quantised(part), "x") for part, _, _ in parts]
            joined = _subclass_state.join(pieces[0][0], [(t, 0, 4096) for _, t in pieces], opt.block_size,
                                          tuple(x.shape), "x")
            _same_state_tensor(joined, whole)


def _same_state_tensor(x, y) -> None:
    names, attrs = x.__tensor_flatten__()
    assert type(x) is type(y) and names == y.__tensor_flatten__()[0] and attrs == y.__tensor_flatten__()[1]
    for n in names:
        assert _same_bytes(getattr(x, n), getattr(y, n)), n


# -- what stays refused --------------------------------------------------------------------------------------------
class _Opaque(torch.Tensor):
    """A tensor subclass without __tensor_flatten__: nothing says what its data is."""


def test_a_subclass_state_without_tensor_flatten_is_refused_before_anything_is_written(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    model(torch.randn(2, 16)).square().mean().backward()
    opt.step()
    p = model[0].weight
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].as_subclass(_Opaque)
    with pytest.raises(NotImplementedError, match=r"'momentum_buffer' of 0.weight is a _Opaque, a tensor subclass "
                                                  r"without __tensor_flatten__"):
        save(tmp_path / "ck", model=model, optimizer=opt)
    assert list(tmp_path.iterdir()) == []


def test_a_saved_state_class_is_looked_up_never_imported():
    """The class named in a checkpoint must be a tensor subclass of a module already imported."""
    from dist_optim.checkpoint import _subclass_state

    with pytest.raises(CheckpointError, match="not imported"):
        _subclass_state.resolve("some_package_never_imported.Codes", "ck")
    with pytest.raises(CheckpointError, match="not a tensor subclass with __tensor_unflatten__"):
        _subclass_state.resolve("os.system", "ck")
    if importlib.util.find_spec("torchao") is not None:
        from torchao.optim.subclass_8bit import OptimState8bit

        assert _subclass_state.resolve("torchao.optim.subclass_8bit.OptimState8bit", "ck") is OptimState8bit

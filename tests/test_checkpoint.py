"""Checkpoints in one process: resume is bitwise the run that never stopped, across optimizer kinds, with every
piece of training state; remapping; atomicity; corrupted and foreign checkpoints give clear errors.

The distributed resume pairs (FSDP2/DDP, 1-4 ranks) are in test_checkpoint_dist.py.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import shutil

import pytest
import torch
from helpers import (
    ADAMW_HPARAMS as ADAMW,  # the kernel (fused=True) is named at each use
)
from helpers import assert_same_params, batches, loss_of, make_model
from torch import nn

import dist_optim
from dist_optim.checkpoint import CheckpointError, CheckpointManager, Remap, load, save

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="DCP needs torch.distributed")

DATA = batches(8)
HALF = 4


def build(mode: str, seed: int = 0):
    """model, optimizer, scheduler for 'in_backward' or 'standard' (same AdamW, same implementation)."""
    model = make_model(seed)
    if mode == "in_backward":
        opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, fused=True, **ADAMW)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(DATA))
    return model, opt, sched


def train(mode: str, model, opt, sched, data) -> list[float]:
    losses = []
    for batch in data:
        loss = loss_of(model, batch)
        loss.backward()
        if mode == "standard":
            opt.step()
            opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def full_state(opt) -> dict:
    return {k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
            for k, v in opt.state_dict()["state"].items()}


def assert_same_optimizer_state(a, b) -> None:
    sa, sb = full_state(a), full_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), f"state[{k}][{key}] differs"


@pytest.mark.parametrize("saved_with", ["in_backward", "standard"])
@pytest.mark.parametrize("resumed_with", ["in_backward", "standard"])
def test_resume_equals_never_stopping(tmp_path, saved_with, resumed_with):
    # reference: never stops, optimizer kind of the second half does not matter (both are bitwise the same)
    ref = build(saved_with)
    train(saved_with, *ref, DATA)

    first = build(saved_with)
    train(saved_with, *first, DATA[:HALF])
    save(tmp_path / "ck", model=first[0], optimizer=first[1], schedulers=first[2], step=HALF, extra={"pos": HALF})

    second = build(resumed_with, seed=123)  # different initial weights: all must come from the checkpoint
    result = load(tmp_path / "ck", model=second[0], optimizer=second[1], schedulers=second[2])
    assert (result.step, result.extra, result.world_size) == (HALF, {"pos": HALF}, 1)
    assert second[2].get_last_lr() == first[2].get_last_lr()
    train(resumed_with, *second, DATA[HALF:])
    assert_same_params(ref[0], second[0])
    assert_same_optimizer_state(ref[1], second[1])
    assert second[1].param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]


def test_implementation_flags_stay_those_of_the_optimizer_loaded_into(tmp_path):
    model, opt, _ = build("standard")
    train("standard", model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), DATA[:2])
    save(tmp_path / "ck", model=model, optimizer=opt)
    model2 = make_model()
    opt2 = torch.optim.AdamW(model2.parameters(), foreach=True, **ADAMW)
    load(tmp_path / "ck", model=model2, optimizer=opt2)
    assert opt2.param_groups[0]["foreach"] is True and opt2.param_groups[0]["fused"] is None


def test_saving_before_the_first_step_changes_nothing(tmp_path):
    model, opt, sched = build("in_backward")
    save(tmp_path / "ck", model=model, optimizer=opt, schedulers=sched, step=0)
    assert len(opt.state) == 0  # torch's get_optimizer_state_dict would have stepped Adam here (torch issue 164929)
    ref = build("in_backward")
    train("in_backward", *ref, DATA)
    model2, opt2, sched2 = build("in_backward", seed=5)
    load(tmp_path / "ck", model=model2, optimizer=opt2, schedulers=sched2)
    assert len(opt2.state) == 0
    train("in_backward", model2, opt2, sched2, DATA)
    assert_same_params(ref[0], model2)


def test_scaler_ema_rng_and_plain_rng_come_back(tmp_path):
    model = make_model()
    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, **ADAMW)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for batch in DATA[:3]:
        loss_of(model, batch).backward()
        ema.update_parameters(model)
        scaler.scale(torch.ones(()))  # creates the scale tensor
        scaler.update(scaler.get_scale() * 2)
    torch.manual_seed(7)
    random.seed(7)
    save(tmp_path / "ck", model=model, optimizer=opt, grad_scaler=scaler, averaged_model=ema)
    expected = (torch.rand(3), random.random(), [p.clone() for p in ema.parameters()], ema.n_averaged.clone(),
                scaler.get_scale())

    model2 = make_model(9)
    opt2 = dist_optim.InBackwardOptimizer(model2, torch.optim.AdamW, **ADAMW)
    ema2 = torch.optim.swa_utils.AveragedModel(model2)
    scaler2 = torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    random.seed(0)
    load(tmp_path / "ck", model=model2, optimizer=opt2, grad_scaler=scaler2, averaged_model=ema2)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert all(torch.equal(p, q) for p, q in zip(ema2.parameters(), expected[2]))
    assert torch.equal(ema2.n_averaged, expected[3]) and scaler2.get_scale() == expected[4]


def test_manager_keeps_last_and_skips_unfinished_saves(tmp_path):
    model, opt, sched = build("in_backward")
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.load("latest", model=model) is None
    for step in range(1, 5):
        train("in_backward", model, opt, sched, DATA[step:step + 1])
        manager.save(step, model=model, optimizer=opt, schedulers=sched)
    assert [p.name for p in manager.checkpoints()] == ["step_00000004", "step_00000003"]
    # an unfinished save (a crash before the rename) and a foreign folder are never "latest"
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000009.partial")
    (tmp_path / "step_00000010").mkdir()
    assert manager.latest() == tmp_path / "step_00000004"
    manager.save(5, model=model, optimizer=opt, schedulers=sched)
    assert (tmp_path / "step_00000009.partial").is_dir()  # pruning touches committed checkpoints only
    assert [p.name for p in manager.checkpoints()] == ["step_00000005", "step_00000004"]
    with pytest.raises(CheckpointError, match="unfinished save"):
        load(tmp_path / "step_00000009", model=model)
    with pytest.raises(FileExistsError, match="already exists"):
        manager.save(5, model=model)


def test_plain_data_that_json_cannot_hold_is_refused_before_writing(tmp_path):
    model = make_model()
    with pytest.raises(TypeError, match=r"at 'extra.loader'.*convert it"):
        save(tmp_path / "ck", model=model, extra={"loader": object()})
    assert not any(tmp_path.iterdir())


def test_async_save_holds_the_state_of_the_moment_it_was_called(tmp_path):
    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    snapshot = copy.deepcopy((model.state_dict(), full_state(opt)))
    pending = save(tmp_path / "ck", model=model, optimizer=opt, async_save=True)
    train("in_backward", model, opt, sched, DATA[2:5])  # steps run while the upload may still be writing
    pending.wait()
    assert pending.done()
    model2, opt2, _ = build("in_backward", seed=3)
    load(tmp_path / "ck", model=model2, optimizer=opt2)
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in snapshot[0].items())
    assert all(torch.equal(v, full_state(opt2)[i][key]) for i, s in snapshot[1].items() for key, v in s.items())


# -- names -------------------------------------------------------------------------------------------------------
def test_wrapper_prefixes_do_not_change_names(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    wrapped = make_model(4)
    wrapped.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in wrapped.layers)
    compiled = torch.compile(wrapped)  # only wrapped, never run: its state_dict has the _orig_mod prefix
    save(tmp_path / "ck", model=model, optimizer=opt)
    opt2 = torch.optim.AdamW(compiled.parameters(), **ADAMW)
    load(tmp_path / "ck", model=compiled, optimizer=opt2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), compiled.parameters()))
    assert opt2.state[compiled._orig_mod.head.weight]["exp_avg"].equal(opt.state[model.head.weight]["exp_avg"])


class Renamed(nn.Module):
    """MLP's layers as ``blocks.{i}.fc`` and its head duplicated into two experts; a new ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8)}) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.experts = nn.ModuleList(nn.ModuleDict({"head": nn.Linear(8, 1)}) for _ in range(2))
        self.gate = nn.Linear(8, 2)


def _trained(tmp_path):
    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    save(tmp_path / "ck", model=model, optimizer=opt)
    return model, opt


def test_remap_renames_duplicates_and_starts_new_names_fresh(tmp_path):
    model, opt = _trained(tmp_path)
    new = Renamed()
    gate = new.gate.weight.clone()
    opt2 = dist_optim.InBackwardOptimizer(new, torch.optim.AdamW, **ADAMW)
    remap = Remap({"layers.{i}": "blocks.{i}.fc", "head": "experts.{e}.head"}, fresh=["gate.*"])
    result = load(tmp_path / "ck", model=new, optimizer=opt2, remap=remap)
    assert result.fresh == ["gate.bias", "gate.weight"]
    for i in range(3):
        assert torch.equal(new.blocks[i].fc.weight, model.layers[i].weight)
        assert torch.equal(opt2.state[new.blocks[i].fc.weight]["exp_avg_sq"], opt.state[model.layers[i].weight]["exp_avg_sq"])
    for e in range(2):
        assert torch.equal(new.experts[e].head.bias, model.head.bias)
        assert torch.equal(opt2.state[new.experts[e].head.weight]["exp_avg"], opt.state[model.head.weight]["exp_avg"])
    assert new.experts[0].head.weight.data_ptr() != new.experts[1].head.weight.data_ptr()
    assert torch.equal(new.gate.weight, gate) and new.gate.weight not in opt2.state


def test_fresh_tensors_keep_their_own_optimizer_state(tmp_path):
    # a checkpoint of part of the model (a pipeline stage's) loaded with strict=False: the other tensors keep their
    # values and their optimizer state, so several parts can be loaded one after the other
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = dist_optim.InBackwardOptimizer(whole, torch.optim.AdamW, **ADAMW, fused=True)
    part = nn.Sequential(copy.deepcopy(whole[0]))
    part_opt = dist_optim.InBackwardOptimizer(part, torch.optim.AdamW, **ADAMW, fused=True)
    for _ in range(2):
        whole(torch.randn(3, 4)).sum().backward()
        part(torch.randn(3, 4)).sum().backward()
    save(tmp_path / "part", model=part, optimizer=part_opt)
    kept = {k: v.clone() for k, v in opt.state[whole[1].weight].items()}
    result = load(tmp_path / "part", model=whole, optimizer=opt, strict=False)
    assert result.fresh == ["1.bias", "1.weight"]
    assert all(torch.equal(v, opt.state[whole[1].weight][k]) for k, v in kept.items()) and len(kept) == 3
    assert torch.equal(opt.state[whole[0].weight]["exp_avg"], part_opt.state[part[0].weight]["exp_avg"])


def test_strict_mismatch_lists_missing_and_unexpected_with_closest_names(tmp_path):
    _trained(tmp_path)
    new = Renamed()
    before = [p.clone() for p in new.parameters()]
    with pytest.raises(CheckpointError) as err:
        load(tmp_path / "ck", model=new, remap=Remap({"layers.{i}": "blocks.{i}.fc"}))
    msg = str(err.value)
    assert "6 missing" in msg and "experts.0.head.weight  (closest in checkpoint: 'head.weight')" in msg
    assert "2 unexpected" in msg and "head.bias  (closest in model: 'gate.bias', 'experts.1.head.bias')" in msg
    assert all(torch.equal(p, q) for p, q in zip(new.parameters(), before))  # nothing loaded
    # dropping old names on request, new ones fresh: loads
    result = load(tmp_path / "ck", model=new, remap=Remap({"layers.{i}": "blocks.{i}.fc"},
                                                             fresh=["experts.*", "gate.*"], ignore=["head.*"]))
    assert result.ignored == ["head.bias", "head.weight"]


def test_a_checkpoint_of_another_model_and_wrong_shapes_are_refused(tmp_path):
    _trained(tmp_path)
    with pytest.raises(CheckpointError, match=r"(?s)2 missing.*10 unexpected"):
        load(tmp_path / "ck", model=nn.Sequential(nn.Linear(8, 8)))
    wide = make_model(width=16)
    wide_opt = dist_optim.InBackwardOptimizer(wide, torch.optim.AdamW, fused=True, **ADAMW)
    wide_sched = torch.optim.lr_scheduler.CosineAnnealingLR(wide_opt, T_max=len(DATA))
    before = _everything(wide, wide_opt, wide_sched)
    with pytest.raises(CheckpointError, match=r"(?s)shapes differ for 9.*layers.0.weight: checkpoint \(8, 8\) vs \(16, 16\)"):
        load(tmp_path / "ck", model=wide, optimizer=wide_opt)
    _assert_unchanged(before, _everything(wide, wide_opt, wide_sched))


def test_remap_rules_are_checked():
    with pytest.raises(ValueError, match="appear only in the source"):
        Remap({"layers.{i}": "blocks"})
    with pytest.raises(ValueError, match="whole component"):
        Remap({"layers.x{i}": "blocks.{i}"})
    with pytest.raises(TypeError, match=r"write \['gate.\*'\]"):
        Remap(fresh="gate.*")


def test_remap_hooks_for_in_memory_state_dicts():
    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    new = Renamed()
    remap = Remap({"layers.{i}": "blocks.{i}.fc", "head": "experts.{e}.head"}, fresh=["gate.*"])
    new.register_load_state_dict_pre_hook(remap.module_hook)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    assert sorted(missing) == ["gate.bias", "gate.weight"] and unexpected == []
    assert torch.equal(new.experts[1].head.weight, model.head.weight)
    opt2 = torch.optim.AdamW(new.named_parameters(), **ADAMW)
    opt2.register_load_state_dict_pre_hook(remap.optimizer_hook)
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[new.blocks[2].fc.bias]["exp_avg"], opt.state[model.layers[2].bias]["exp_avg"])
    assert torch.equal(opt2.state[new.experts[1].head.weight]["exp_avg"], opt.state[model.head.weight]["exp_avg"])
    assert new.gate.weight not in opt2.state


# -- damaged checkpoints -------------------------------------------------------------------------------------------
def test_truncated_shard_and_missing_files_are_named(tmp_path):
    _trained(tmp_path)
    model2, opt2, sched2 = _other_run()
    before = _everything(model2, opt2, sched2)

    def refused(message: str) -> None:
        with pytest.raises(CheckpointError, match=message):
            load(tmp_path / "ck", model=model2, optimizer=opt2)
        _assert_unchanged(before, _everything(model2, opt2, sched2))

    shard = next((tmp_path / "ck").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    refused(rf"{shard.name} is truncated: \d+ bytes on disk, the metadata needs")
    shard.unlink()
    refused(rf"{shard.name} is missing")
    (tmp_path / "ck" / ".metadata").unlink()
    refused(r"\.metadata is missing")
    (tmp_path / "ck" / "COMMITTED").unlink()
    refused("not a committed dist_optim checkpoint")


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_loading_never_executes_code_from_the_checkpoint(tmp_path):
    model, _ = _trained(tmp_path)
    pwned = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Payload(str(pwned))))
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read .*refused to load global posix.mkdir"):
        load(tmp_path / "ck", model=model)
    assert not pwned.exists()
    (tmp_path / "ck" / "dist_optim.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="dist_optim.json is corrupted"):
        load(tmp_path / "ck", model=model)


def test_manager_rejects_unknown_objects_and_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        CheckpointManager(tmp_path, keep_last=0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['scheduler'\]"):
        manager.save(1, model=make_model(), scheduler=None)
    with pytest.raises(ValueError, match="non-negative int"):
        manager.save(-1, model=make_model())
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("via", ["checkpoint", "state_dict"])
def test_previous_norm_clipping_resumes_exactly(tmp_path, via):
    """The first step after a resume clips with the norm of the step before the checkpoint, as without a stop."""
    def make(seed=0):
        model = make_model(seed)
        return model, dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, max_grad_norm=0.05,
                                                     clip_mode="previous_norm", **ADAMW)

    ref_model, ref_opt = make()
    for batch in DATA:
        loss_of(ref_model, batch).backward()
    model, opt = make()
    for batch in DATA[:HALF]:
        loss_of(model, batch).backward()
    assert opt.state_dict()["in_backward"]["previous_grad_norm"] == opt.grad_norm.item() > 0.05
    model2, opt2 = make(seed=3)
    if via == "checkpoint":
        save(tmp_path / "ck", model=model, optimizer=opt)
        load(tmp_path / "ck", model=model2, optimizer=opt2)
    else:
        model2.load_state_dict(model.state_dict())
        opt2.load_state_dict(opt.state_dict())
    for batch in DATA[HALF:]:
        loss_of(model2, batch).backward()
    assert_same_params(ref_model, model2)
    # a standard optimizer's state dict has no previous norm: the next step is not clipped, as documented
    opt2.load_state_dict(torch.optim.AdamW(model2.parameters(), **ADAMW).state_dict())
    assert opt2._edges.policy.previous_norm is None


# -- reliability (issue 11): concurrent writers, damaged or foreign content, a full disk -----------------------------
def _rehash(folder, name) -> None:
    """Record ``name``'s new content in the commit marker, as a writer that stored bad data would have."""
    import hashlib
    import json

    marker = json.loads((folder / "COMMITTED").read_text())
    data = (folder / name).read_bytes()
    marker["files"][name] = len(data)
    if "sha256" in marker:
        marker["sha256"][name] = hashlib.sha256(data).hexdigest()
    (folder / "COMMITTED").write_text(json.dumps(marker))


def _edit_plain(folder, edit) -> None:
    import json

    plain = json.loads((folder / "dist_optim.json").read_text())
    edit(plain)
    (folder / "dist_optim.json").write_text(json.dumps(plain))
    _rehash(folder, "dist_optim.json")


def test_a_committed_folder_without_metadata_is_never_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    model = make_model()
    manager.save(1, model=model)
    manager.save(2, model=model)
    (tmp_path / "step_00000002" / ".metadata").unlink()
    assert manager.latest() == tmp_path / "step_00000001"
    manager.save(3, model=model)  # pruning keeps the good step 1 and the new step 3
    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000001"]


def _set(path: str, value):
    def edit(plain):
        *parents, last = path.split(".")
        node = plain
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return edit


_DELETE = object()
DAMAGES = {
    "negative lr": ("optimizer.param_groups.0.lr", -1.0, r"optimizer\.param_groups\[0\]\.lr must be a number >= 0"),
    "lr a string": ("optimizer.param_groups.0.lr", "fast", r"optimizer\.param_groups\[0\]\.lr must be a number"),
    "groups not a list": ("optimizer.param_groups", {"a": 1}, r"optimizer\.param_groups must be a list"),
    "param name not a string": ("optimizer.param_groups.0.params.0", 7, r"params\[0\] must be a str"),
    "values not a dict": ("optimizer.values", [], r"optimizer\.values must be a dict"),
    "no model names": ("model", _DELETE, r"model is missing"),
    "step a string": ("step", "three", r"step must be an int >= 0 or null"),
    "world size 0": ("world_size", 0, r"world_size must be an int >= 1"),
    "scheduler not a dict": ("schedulers.0", 3, r"schedulers\[0\] must be a dict"),
    "python rng damaged": ("rng.0.python", 5, r"rng\[0\]\.python"),
    "extra not a dict": ("extra", [1], r"extra must be a dict"),
}


def _everything(model, opt, sched, extra: tuple = ()) -> list:
    """What a load could change: the model's and the optimizer's tensors, the lr, the scheduler, the RNGs and
    ``extra`` modules' state dicts (an averaged model), cloned."""
    tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()},
               **{f"opt.{k}.{kk}": vv for k, v in full_state(opt).items() for kk, vv in v.items()}}
    for i, m in enumerate(extra):
        tensors.update({f"extra{i}.{k}": v for k, v in m.state_dict().items()})
    return [{k: v.clone() for k, v in tensors.items()}, opt.param_groups[0]["lr"], sched.state_dict(),
            torch.get_rng_state(), random.getstate()]


def _assert_unchanged(before: list, after: list) -> None:
    assert before[0].keys() == after[0].keys()
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), f"{k} changed by a refused load"
    assert before[1:3] == after[1:3] and torch.equal(before[3], after[3]) and before[4] == after[4]


def _other_run():
    """A model, optimizer and scheduler a refused load must leave alone: another seed, one step trained."""
    model2, opt2, sched2 = build("in_backward", seed=5)
    train("in_backward", model2, opt2, sched2, DATA[2:3])
    return model2, opt2, sched2


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_plain_data_is_refused_before_anything_changes(tmp_path, damage):
    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    save(tmp_path / "ck", model=model, optimizer=opt, schedulers=sched, step=2)
    path, value, message = DAMAGES[damage]
    _edit_plain(tmp_path / "ck", _set(path, value))
    model2, opt2, sched2 = _other_run()
    before = _everything(model2, opt2, sched2)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "ck", model=model2, optimizer=opt2, schedulers=sched2)
    _assert_unchanged(before, _everything(model2, opt2, sched2))


@pytest.mark.parametrize("missing", ["optimizer", "schedulers", "grad_scaler", "averaged_model"])
def test_a_piece_that_was_not_saved_is_refused_before_anything_loads(tmp_path, missing):
    model, opt, sched = build("in_backward")
    train("in_backward", model, opt, sched, DATA[:2])
    pieces = dict(optimizer=opt, schedulers=sched, grad_scaler=torch.amp.GradScaler("cpu", init_scale=8.0),
                  averaged_model=torch.optim.swa_utils.AveragedModel(model))
    save(tmp_path / "ck", model=model, **{k: v for k, v in pieces.items() if k != missing})
    model2, opt2, sched2 = _other_run()
    scaler2, ema2 = torch.amp.GradScaler("cpu", init_scale=2.0), torch.optim.swa_utils.AveragedModel(model2)
    before, scale = _everything(model2, opt2, sched2, (ema2,)), scaler2.state_dict()
    message = {"optimizer": "holds no optimizer state", "schedulers": r"holds 0 scheduler state\(s\); 1 given",
               "grad_scaler": "holds no grad scaler state", "averaged_model": "holds no averaged model"}[missing]
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "ck", model=model2, optimizer=opt2, schedulers=sched2, grad_scaler=scaler2,
             averaged_model=ema2)
    _assert_unchanged(before, _everything(model2, opt2, sched2, (ema2,)))
    assert scaler2.state_dict() == scale


def test_two_parameters_with_one_checkpoint_name_are_refused_before_writing(tmp_path):
    model = nn.Module()
    model.x = nn.Linear(2, 2)
    model.module = nn.Module()  # "module." is DDP's prefix, removed from checkpoint names
    model.module.x = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'module\.x\.weight' and 'x\.weight'|'x\.weight' and 'module\.x\.weight'"):
        save(tmp_path / "ck", model=model)
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())  # nothing written, no staging left


def test_metadata_paths_outside_the_checkpoint_are_refused(tmp_path):
    model, _ = _trained(tmp_path)
    shutil.copytree(tmp_path / "ck", tmp_path / "elsewhere")
    meta_file = tmp_path / "ck" / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere/" + info.relative_path
    meta_file.write_bytes(pickle.dumps(metadata))
    _rehash(tmp_path / "ck", ".metadata")
    model2, opt2, sched2 = _other_run()
    before = _everything(model2, opt2, sched2)
    with pytest.raises(CheckpointError, match=r"storage path '\.\./elsewhere/.*' points outside the checkpoint"):
        load(tmp_path / "ck", model=model2, optimizer=opt2)
    _assert_unchanged(before, _everything(model2, opt2, sched2))
    assert model is not None


def test_a_shard_copied_from_another_checkpoint_is_refused(tmp_path):
    model, opt, _ = build("in_backward")
    save(tmp_path / "a", model=model, optimizer=opt)
    other, other_opt, _ = build("in_backward", seed=1)
    save(tmp_path / "b", model=other, optimizer=other_opt)
    shard = next((tmp_path / "a").glob("*.distcp"))
    shutil.copyfile(tmp_path / "b" / shard.name, shard)  # same size: only the content tells them apart
    model2, opt2, sched2 = _other_run()
    before = _everything(model2, opt2, sched2)
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not hold the content written at commit"):
        load(tmp_path / "a", model=model2, optimizer=opt2)
    _assert_unchanged(before, _everything(model2, opt2, sched2))


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system, so that DCP's own writes fail for lack of space."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=1m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("needs permission to mount a 1 MiB tmpfs (root) to fill a real disk")
    yield mount
    os.system(f"umount {mount}")


def test_a_full_disk_raises_a_checkpoint_error_and_leaves_no_staging_folder(tiny_disk):
    model = nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()  # 3 MiB of weights and state on a 1 MiB disk
    with pytest.raises(CheckpointError, match=r"saving .*ck failed: no space left on .*; the partial save was removed"):
        save(tiny_disk / "ck", model=model, optimizer=opt)
    assert list(tiny_disk.iterdir()) == []


@pytest.mark.parametrize("saved,loaded", [("adamw", "sgd"), ("sgd", "adamw"), ("adamw", "muon_group")])
def test_another_optimizer_class_is_refused_and_the_weights_alone_load(tmp_path, saved, loaded):
    def build(model, kind):
        if kind == "adamw":
            return dist_optim.InBackwardOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return dist_optim.InBackwardOptimizer(
            [{"params": rest}, {"params": matrices, "optimizer_class": torch.optim.SGD, "lr": 0.1}],
            torch.optim.AdamW, **ADAMW)

    model = make_model()
    opt = build(model, saved)
    for batch in batches(2):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    save(tmp_path / "ckpt", model=model, optimizer=opt)
    target = make_model(seed=3)
    target_opt = build(target, loaded)
    before = copy.deepcopy(target_opt.state_dict())
    with pytest.raises(CheckpointError, match=r"param group \d was saved by torch\.optim\.\w+\.\w+ and would be loaded"
                                              r" into torch\.optim\.\w+\.\w+.*load the weights only"):
        load(tmp_path / "ckpt", model=target, optimizer=target_opt)
    assert target_opt.state_dict()["param_groups"] == before["param_groups"] and not target_opt.state
    assert_same_params(target, make_model(seed=3))  # refused before anything was transferred
    load(tmp_path / "ckpt", model=target)  # the opt-in: weights only
    assert_same_params(target, model)


def test_an_incomplete_in_backward_step_is_not_saved_unless_forced(tmp_path):
    model = make_model()
    opt = dist_optim.InBackwardOptimizer(model.parameters(), torch.optim.AdamW, per_parameter=True, **ADAMW)
    x, y = batches(1)[0]

    def boom(grad):
        raise RuntimeError("boom")

    h = torch.tanh(model.layers[0](x))
    h.register_hook(boom)  # raises after the layers above it were stepped
    out = model.head(model.norm(torch.tanh(model.layers[2](torch.tanh(model.layers[1](h))))))
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.mse_loss(out, y).backward()
    assert opt.step_incomplete
    with pytest.raises(CheckpointError, match="in-backward step is incomplete.*force=True"):
        save(tmp_path / "refused", model=model, optimizer=opt)
    assert not (tmp_path / "refused").exists() and not list(tmp_path.iterdir())
    manager = CheckpointManager(tmp_path / "managed")
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.save(1, model=model, optimizer=opt)
    manager.save(1, model=model, optimizer=opt, force=True)
    save(tmp_path / "forced", model=model, optimizer=opt, force=True)
    steps = {p: int(s["step"]) for p, s in opt.state.items()}
    fresh = make_model(seed=5)
    fresh_opt = dist_optim.InBackwardOptimizer(fresh.parameters(), torch.optim.AdamW, **ADAMW)
    load(tmp_path / "forced", model=fresh, optimizer=fresh_opt)
    assert sorted(int(s["step"]) for s in fresh_opt.state.values()) == sorted(steps.values())  # what was saved

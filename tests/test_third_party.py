"""Every optimizer class of the packages users bring (pytorch-optimizer, torch-optimi, schedulefree, bitsandbytes,
torchao, torch.optim's own): exact with its own standard loop, state-dict round trips included, or refused at
construction before anything steps.

Each class trains a small model (an embedding, Linear layers, a LayerNorm) with its own loop and in backward in one
bucket, several buckets and per parameter, with the class's own kernel defaults on both sides (the same code runs
on both: bitwise). A refusal must be a ``NotImplementedError`` (or the class's own construction error, which the
standard loop raises too) and leave the parameters and torch's random stream as they were.

torchao's classes run their step eagerly here, on both sides of each comparison (``helpers.eager_compile``): what
is checked is how the class steps in backward, and eagerly the same code runs. Compiled, every parameter shape of
every class compiles anew on a cold inductor cache (CI's every run); tests/test_torchao_step.py runs the compiled
step in buckets against torchao's own compiled loop.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import random
import re
import warnings

import numpy
import pytest
import torch
from helpers import eager_compile, eagerly
from torch import nn

import dist_optim
from dist_optim._planner import _lowbit
from dist_optim.engine._classes import is_torch_step

STEPS = 2  # per phase: train, then resume across (a counter written at step 1 is read at step 2)
MODES = {
    "one_bucket": {"bucket_cap_mb": float("inf")},
    "buckets": {"bucket_cap_mb": 1e-4},  # each autograd node's gradients a bucket of their own
    "per_parameter": {"per_parameter": True},
}
# Options a class needs beyond lr to be built on a plain parameter list, or to step on CPU.
KWARGS: dict[str, dict] = {
    **{f"bitsandbytes.{n}": {"momentum": 0.9} for n in ("SGD", "SGD32bit", "SGD8bit", "LARS", "LARS32bit",
                                                          "LARS8bit")},
    # bitsandbytes keeps tensors below min_8bit_size (4096 elements) in 32 bits: these small ones take the 8-bit path
    **{f"bitsandbytes.{n}": {"min_8bit_size": 16} for n in (
        "AdEMAMix8bit", "Adagrad8bit", "Adam8bit", "AdamW8bit", "LAMB8bit", "Lion8bit", "PagedAdEMAMix8bit",
        "PagedAdam8bit", "PagedAdamW8bit", "PagedLion8bit", "RMSprop8bit")},
    "pytorch_optimizer.Ranger21": {"num_iterations": 2 * STEPS},
    "pytorch_optimizer.BSAM": {"num_data": 6},
    **{f"pytorch_optimizer.{n}": {"base_optimizer": torch.optim.SGD} for n in ("SAM", "FriendlySAM", "LookSAM")},
}
# Classes that take something else than parameters first, or need hardware this machine lacks: not constructed.
NOT_CONSTRUCTED = {
    "pytorch_optimizer.Lookahead": "wraps another optimizer instance",
    "pytorch_optimizer.PCGrad": "wraps another optimizer instance",
    "pytorch_optimizer.ScheduleFreeWrapper": "wraps another optimizer instance",
    "pytorch_optimizer.OrthoGrad": "wraps another optimizer class",
    "pytorch_optimizer.TRAC": "wraps another optimizer instance",
    "pytorch_optimizer.SafeFP16Optimizer": "wraps another optimizer instance",
    "pytorch_optimizer.AdamMini": "takes the model, not parameters",
    "pytorch_optimizer.LOMO": "takes the model, not parameters",
    "pytorch_optimizer.AdaLOMO": "takes the model, not parameters",
    "torch.SparseAdam": "needs sparse gradients",
}
PACKAGES = ["pytorch_optimizer", "optimi", "schedulefree", "bitsandbytes.optim", "torchao.optim", "torch.optim"]


def _classes() -> list:
    out = []
    for package in PACKAGES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(package)
        except Exception as e:  # noqa: BLE001 - any import failure means the package is not usable here
            out.append(pytest.param(package, None, marks=pytest.mark.skip(reason=f"{package}: {e}"), id=package))
            continue
        seen = {}
        for name in sorted(dir(module)):
            cls = getattr(module, name)
            if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
                    and cls not in seen.values()):
                seen[name] = cls
        for name, cls in seen.items():
            key = f"{package.split('.')[0]}.{name}"
            out.append(pytest.param(key, cls, id=key))
    return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 8)  # 4096 elements: bitsandbytes and torchao quantise it (8/4-bit states)
        self.l1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(torch.tanh(self.l1(self.emb(x).mean(1)))))


def _data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 512, (6, 3), generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _standard(model, opt, data) -> None:
    for batch in data:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()


def _in_backward(model, opt, data) -> None:
    for batch in data:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _differs(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"
        for k in a:
            d = _differs(a[k], b[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} != {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            d = _differs(x, y, f"{where}[{k}]")
            if d:
                return d
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        subclass = hasattr(a, "__tensor_flatten__") or hasattr(b, "__tensor_flatten__")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or subclass and type(a) is not type(b):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if subclass:  # a quantised state (torchao): its codes and scales
            names = a.__tensor_flatten__()[0]
            return _differs([getattr(a, n) for n in names], [getattr(b, n) for n in names], f"{where}{names}")
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())):
            return None
        return f"{where}: values differ (max {(a.double() - b.double()).abs().max().item():.3g})"
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if hasattr(a, "__dict__") and not callable(a):  # an object kept in the state (a preconditioner): its fields
        return _differs(vars(a), vars(b), where)
    try:
        same = a == b or (a != a and b != b)
    except Exception:  # noqa: BLE001 - values without a usable ==
        same = True
    return None if same else f"{where}: {a!r} != {b!r}"


def _copy(value):
    """A deep copy that quantised states survive (torchao's subclasses have no clone)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _state_dict(opt) -> dict:
    sd = _copy(opt.state_dict())
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


# Muon-style classes read "use_muon" in each group: the matrices take Muon, the rest its AdamW.
USE_MUON = {"pytorch_optimizer.Muon", "pytorch_optimizer.AdaGO", "pytorch_optimizer.AdaMuon",
            "pytorch_optimizer.NorMuon", "pytorch_optimizer.MuonClip", "pytorch_optimizer.DistributedMuon"}


def _groups(key: str, model) -> list:
    params = list(model.parameters())
    if key not in USE_MUON:
        return params
    return [{"params": [p for p in params if p.ndim == 2], "use_muon": True},
            {"params": [p for p in params if p.ndim != 2], "use_muon": False}]


def _build(cls, model, kwargs, key: str = ""):
    return cls(_groups(key, model), **kwargs)


def _modes(opt, name: str) -> None:
    method = getattr(opt, name, None)
    if callable(method):
        method()


def _seed(seed: int) -> None:
    """Every global random stream a class may draw from (Kron draws from numpy's), the same on both sides."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def _rng_states() -> list:
    return [torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].tolist()]


def _kwargs(key: str, cls) -> dict:
    kwargs = {"lr": 1e-3, **KWARGS.get(key, {})}
    if is_torch_step(cls) and "foreach" in inspect.signature(cls.__init__).parameters:
        kwargs["foreach"] = True  # a torch class with both unset gets dist_optim's kernel: name it on both sides
    return kwargs


def _check_class(key: str, cls, mode: str) -> str:
    kwargs = _kwargs(key, cls)
    data = _data(2 * STEPS, seed=1)
    first, second = data[:STEPS], data[STEPS:]
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    before = _params(model)
    _seed(5)
    own_loop_fails = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            std = _build(cls, ref, kwargs, key)
            rng_std = _rng_states()
            _modes(std, "train")
            _seed(2)
            _standard(ref, std, first)
    except Exception as e:  # noqa: BLE001 - a class its own plain loop cannot step (a closure, a Hessian)
        own_loop_fails = f"its own loop fails here: {type(e).__name__}: {str(e)[:200]}"
    _seed(5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = dist_optim.InBackwardOptimizer(_groups(key, model), cls, **MODES[mode], **kwargs)
    except (NotImplementedError, ValueError) as e:  # ValueError: a class that needs a closure (LBFGS)
        if own_loop_fails and not isinstance(e, NotImplementedError) and "closure" not in str(e):
            pytest.skip(own_loop_fails)  # the class's own construction error
        assert cls.__name__ in str(e), e
        assert isinstance(e, NotImplementedError) or "closure" in str(e), e
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "refused after stepping"
        return f"refused: {e}"
    except Exception:  # noqa: BLE001 - the class's own construction error, as in its own loop
        if own_loop_fails:
            pytest.skip(own_loop_fails)
        raise
    if own_loop_fails:
        pytest.skip(f"{own_loop_fails}; accepted in backward, where its step fails the same way")
    assert _differs(rng_std, _rng_states()) is None, "construction drew other random numbers than the class's"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _modes(opt, "train")
        _seed(2)
        try:
            _in_backward(model, opt, first)
        except RuntimeError as e:  # a draw the construction probe did not see: refused at the step that drew it
            if "drew random numbers from torch's global generator while stepping one bucket" not in str(e):
                raise
            assert cls.__name__ in str(e) and mode != "one_bucket", e
            return f"refused at its first draw: {e}"
    diff = _differs([p.detach() for p in ref.parameters()], [p.detach() for p in model.parameters()], "params")
    assert diff is None, f"training differs: {diff}"
    sd_std, sd_ib = _state_dict(std), _state_dict(opt)
    diff = _differs(sd_std, sd_ib, "state_dict")
    assert diff is None, f"state dicts differ: {diff}"
    # resume across, against the class's own resume (a class may keep something outside its state dict, such as
    # a random generator, which no resume carries): the standard loop's state dict into a new standard optimizer
    # and into a new in-backward one, and the in-backward one's into a new standard one
    resumed = [copy.deepcopy(ref) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        std_e = _build(cls, resumed[0], kwargs, key)
        std_e.load_state_dict(_copy(std.state_dict()))
        opt_c = dist_optim.InBackwardOptimizer(_groups(key, resumed[1]), cls, **MODES[mode], **kwargs)
        opt_c.load_state_dict(_copy(std.state_dict()))
        std_d = _build(cls, resumed[2], kwargs, key)
        std_d.load_state_dict(_copy(opt.state_dict()))
        for o, m, loop in ((std_e, resumed[0], _standard), (opt_c, resumed[1], _in_backward),
                           (std_d, resumed[2], _standard)):
            _modes(o, "train")
            _seed(3)
            loop(m, o, second)
            _modes(o, "eval")
    expected = [p.detach() for p in resumed[0].parameters()]
    diff = _differs(expected, [p.detach() for p in resumed[1].parameters()], "params")
    assert diff is None, f"standard -> in-backward resume differs: {diff}"
    diff = _differs(expected, [p.detach() for p in resumed[2].parameters()], "params")
    assert diff is None, f"in-backward -> standard resume differs: {diff}"
    diff = _differs(_state_dict(std_e), _state_dict(opt_c), "state_dict")
    assert diff is None, f"state dicts differ after a resume: {diff}"
    return "exact"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("key,cls", _classes())
def test_exact_or_refused(key, cls, mode):
    if key in NOT_CONSTRUCTED:
        pytest.skip(NOT_CONSTRUCTED[key])
    with eager_compile() if key.startswith("torchao.") else contextlib.nullcontext():  # the module's docstring
        _check_class(key, cls, mode)


# -- the rule, on classes written here (no package needed) --------------------------------------------------------
class GroupCounterSGD(torch.optim.Optimizer):
    """Keeps its step count in the group, as pytorch-optimizer's and torch-optimi's classes do."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["step"])


class GlobalNormSGD(GroupCounterSGD):
    """Scales every step by the group's gradient norm: couples the tensors of the group."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])

    def calibrate(self):
        """A public method of the class's own."""


def test_group_counter_advances_once_per_step_through_schedulers_and_added_groups():
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    head = lambda m: [m.l2.weight, m.l2.bias]  # noqa: E731
    rest = lambda m: [p for n, p in m.named_parameters() if not n.startswith("l2.")]  # noqa: E731
    std = GroupCounterSGD(rest(ref))
    opt = dist_optim.InBackwardOptimizer(rest(model), GroupCounterSGD, bucket_cap_mb=1e-4)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (std, opt)]
    data = _data(4, seed=1)
    for k, batch in enumerate(data):
        if k == 2:  # a group added mid-training starts its own count
            std.add_param_group({"params": head(ref)})
            opt.add_param_group({"params": head(model)})
        _standard(ref, std, [batch])
        _in_backward(model, opt, [batch])
        for s in scheds:
            s.step()
    assert len(opt.buckets) > 1
    assert _differs(list(ref.parameters()), list(model.parameters())) is None
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in std.param_groups] == [4, 2]
    assert _differs(_state_dict(std), _state_dict(opt)) is None
    resumed = copy.deepcopy(model)
    again = dist_optim.InBackwardOptimizer(rest(resumed), GroupCounterSGD, bucket_cap_mb=1e-4)
    again.add_param_group({"params": head(resumed)})
    again.load_state_dict(std.state_dict())
    assert [g["step"] for g in again.param_groups] == [4, 2]


def test_a_coupled_class_is_refused_by_behaviour_and_exact_in_one_bucket():
    torch.manual_seed(0)
    model = Model()
    before = _params(model)
    with pytest.raises(NotImplementedError, match=r"GlobalNormSGD cannot be stepped one bucket at a time: its "
                                                  r"parameters differ .*bucket_cap_mb=float\('inf'\)"):
        dist_optim.InBackwardOptimizer(model, GlobalNormSGD, lr=0.1)
    assert _differs(before, list(model.parameters())) is None
    ref = copy.deepcopy(model)
    std = GlobalNormSGD(list(ref.parameters()))
    opt = dist_optim.InBackwardOptimizer(list(model.parameters()), GlobalNormSGD, bucket_cap_mb=float("inf"))
    data = _data(3, seed=1)
    _standard(ref, std, data)
    _in_backward(model, opt, data)
    assert _differs(list(ref.parameters()), list(model.parameters())) is None


def test_methods_of_the_class_are_forwarded_or_refused_by_name():
    model = Model()
    opt = dist_optim.InBackwardOptimizer(model, GlobalNormSGD, bucket_cap_mb=float("inf"))
    with pytest.raises(AttributeError, match="GlobalNormSGD.calibrate is not available on InBackwardOptimizer"):
        opt.calibrate()
    assert not hasattr(opt, "train") and not hasattr(opt, "eval")  # what HF Trainer tests before calling them
    adamw = dist_optim.InBackwardOptimizer(Model(), torch.optim.AdamW, lr=1e-3)
    assert not hasattr(adamw, "train")


def test_probes_leave_the_random_stream_alone():
    torch.manual_seed(0)
    model, other = Model(), Model()
    state = _rng_states()
    dist_optim.InBackwardOptimizer(model, GroupCounterSGD, lr=0.1)  # probed by behaviour
    dist_optim.InBackwardOptimizer(other, torch.optim.Adagrad, lr=0.1)  # torch's kernel probe
    assert _differs(state, _rng_states()) is None


@pytest.mark.parametrize("path", ["optimi.AdamW", "schedulefree.AdamWScheduleFree", "bitsandbytes.optim.Adam8bit"])
def test_checkpoint_round_trip(path, tmp_path):
    """dist_optim.checkpoint keeps what these classes keep: group tensors (torch-optimi's step), schedule-free's
    group keys, bitsandbytes' 8-bit codes and their scales, and the run resumes exactly. torchao's quantised states
    (tensor subclasses), and low-bit states across world sizes: tests/test_checkpoint_low_bit.py."""
    from dist_optim.checkpoint import load, save

    module, _, name = path.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(pytest.importorskip(module), name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1))  # 4096: quantised by bitsandbytes
    resumed = copy.deepcopy(model)
    x = torch.randn(4, 16)
    try:  # the class's own loop, once
        own, own_model = None, copy.deepcopy(model)
        own = cls(own_model.parameters(), lr=1e-2)
        _modes(own, "train")
        own_model(x).square().mean().backward()
        own.step()
    except Exception as e:  # noqa: BLE001 - e.g. torchao's compiled step where inductor cannot build it
        pytest.skip(f"its own loop fails here: {type(e).__name__}: {str(e)[:200]}")
    opt = dist_optim.InBackwardOptimizer(model, cls, lr=1e-2, bucket_cap_mb=1e-4)
    _modes(opt, "train")
    for _ in range(2):
        model(x).square().mean().backward()
    save(str(tmp_path / "ck"), model=model, optimizer=opt)
    again = dist_optim.InBackwardOptimizer(resumed, cls, lr=1e-2, bucket_cap_mb=1e-4)
    load(str(tmp_path / "ck"), model=resumed, optimizer=again)
    _modes(again, "train")
    assert _differs(_state_dict(opt), _state_dict(again)) is None
    if "8bit" in name:  # the quantised path, not the 32-bit one small tensors take
        codes = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        assert any(v.dtype == torch.uint8 or "8bit" in type(v).__name__.lower() for v in codes), opt.state
    for m in (model, resumed):
        m(x).square().mean().backward()
    assert _differs(list(model.parameters()), list(resumed.parameters())) is None


# -- low-bit states under DDP and FSDP2, 2 gloo ranks --------------------------------------------------------------
LOW_BIT = {"bitsandbytes.optim.Adam8bit": {"min_8bit_size": 16}, "torchao.optim.AdamW8bit": {},
           "torchao.optim.AdamW4bit": {}}


def _low_bit(path: str):
    module, _, name = path.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), name)


def _low_bit_models(ctx, path, wrapper, copies):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 16), nn.Tanh(), nn.Linear(16, 1))  # 8192: quantised shards
    models = [copy.deepcopy(base) for _ in range(copies)]
    if wrapper == "ddp":
        return [DDP(m) for m in models]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world,))
    for m in models:
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return models


@eagerly  # torchao's step uncompiled on both sides (the module's docstring)
def _low_bit_scenario(ctx, path, wrapper):
    cls, kwargs = _low_bit(path), {"lr": 1e-2, **LOW_BIT[path]}
    a, b = _low_bit_models(ctx, path, wrapper, 2)
    options = {"bucket_cap_mb": 1e-3} if wrapper == "ddp" else {}
    before = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in a.parameters()]
    try:
        opt = dist_optim.InBackwardOptimizer(a, cls, **options, **kwargs)
    except NotImplementedError as e:  # before anything stepped
        after = [(p.to_local() if hasattr(p, "to_local") else p) for p in a.parameters()]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        return f"refused: {e}"
    ref = cls(b.parameters(), **kwargs)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    for k in range(3):
        x = torch.randn(4, 16, generator=g)
        try:
            b(x).square().mean().backward()
            ref.step()
            ref.zero_grad()
        except Exception as e:  # noqa: BLE001 - the class's own loop cannot run here
            assert k == 0, e
            return f"own loop fails: {type(e).__name__}: {e}"
        a(x).square().mean().backward()
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in a.parameters()]
    expected = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in b.parameters()]
    assert _differs(expected, local, "params") is None, _differs(expected, local, "params")
    local_state = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    held = {st.data_ptr(): st.nbytes() for v in local_state for st in _lowbit.storages(v)}
    return "exact: " + ",".join(sorted({type(v).__name__ for v in local_state if isinstance(v, torch.Tensor)})) + \
        f"; state bytes {sum(held.values())}"


# bitsandbytes' kernels take plain tensors only: under FSDP2 its own loop fails inside step(), in backward it is
# refused at construction
LOW_BIT_EXPECTED = {("bitsandbytes.optim.Adam8bit", "fsdp2"): "refused: .*Adam8bit cannot be stepped.*DTensor"}


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("path", list(LOW_BIT))
def test_low_bit_states_under_ddp_and_fsdp2(ranks, path, wrapper):
    """Bitwise with the same wrapper and the class's own loop on 2 ranks, the quantised states included, or
    refused at construction."""
    try:
        _low_bit(path)
    except ImportError as e:
        pytest.skip(str(e))
    results = ranks.run(2, _low_bit_scenario, path=path, wrapper=wrapper)
    if all(r.startswith("own loop fails") for r in results):
        pytest.skip(results[0][:300])
    # a class whose step fails on the probe where it also fails in its own loop (torchao's compiled step where
    # inductor cannot build it) is refused, which is allowed
    expected = LOW_BIT_EXPECTED.get((path, wrapper), "exact: .*(OptimState|Tensor)|refused: .*stepping it .*raised")
    assert all(re.match(expected, r, flags=re.S) for r in results), results
    if results[0].startswith("exact"):  # the planner's state of rank 0, from the class's own layout (issue 34)
        measured = int(re.search(r"state bytes (\d+)", results[0]).group(1))
        assert _planned_low_bit_state(path, wrapper) == measured, (results[0], path, wrapper)


def _planned_low_bit_state(path: str, wrapper: str) -> int:
    def model_fn() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 16), nn.Tanh(), nn.Linear(16, 1))
    p = dist_optim.plan(model_fn, lambda: torch.randn(4, 16), lambda m, x: m(x).square().mean(), _low_bit(path),
                        parallel=wrapper, world_size=2, lr=1e-2, **LOW_BIT[path],
                        **({"bucket_cap_mb": 1e-3} if wrapper == "ddp" else
                           {"fsdp_units": lambda m: [layer for layer in m if isinstance(layer, nn.Linear)]}))
    return p.in_backward.breakdown["optimizer_state"]


@pytest.mark.parametrize("name", ["AdamMini", "LOMO", "AdaLOMO"])
def test_a_class_that_takes_the_model_is_refused_in_one_line_before_anything_is_attached(name):
    cls = getattr(pytest.importorskip("pytorch_optimizer"), name)
    model = Model()
    before = _params(model)
    with pytest.raises(NotImplementedError, match=rf"^pytorch_optimizer\.{name} takes the model \('model'\) rather "
                                                  r"than parameters.*standard training loop$"):
        dist_optim.InBackwardOptimizer(model, cls, lr=1e-3)
    assert all(not p.__dict__ for p in model.parameters())  # no engine linked
    _loss(model, _data(1, 0)[0]).backward()  # plain autograd: no hook of ours runs, nothing is stepped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())


def test_a_draw_the_probe_did_not_see_is_refused_at_the_step_that_draws_and_one_bucket_is_exact():
    """pytorch-optimizer's Alice draws a randperm only for a tensor with more rows than its leading_basis (40):
    never on the probe's small tensors. Per bucket each tensor would get other numbers than in the standard loop's
    one step() (a 3e-8 difference from step 1, silently, before): refused at the first step that draws, by name."""
    cls = pytest.importorskip("pytorch_optimizer").Alice
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64))
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for mode in ("buckets", "per_parameter"):
        model = copy.deepcopy(ref)
        opt = dist_optim.InBackwardOptimizer(model, cls, lr=1e-2, **MODES[mode])
        with pytest.raises(RuntimeError, match=r"^pytorch_optimizer\.Alice drew random numbers from torch's global "
                                               r"generator while stepping one bucket.*bucket_cap_mb=float\('inf'\)"):
            model(data[0]).square().mean().backward()
        assert opt.step_incomplete
    model, std_model = copy.deepcopy(ref), copy.deepcopy(ref)
    opt = dist_optim.InBackwardOptimizer(model, cls, lr=1e-2, bucket_cap_mb=float("inf"))
    std = cls(std_model.parameters(), lr=1e-2)
    for x in data:
        _seed(3)
        std_model(x).square().mean().backward()
        std.step()
        std.zero_grad()
        _seed(3)
        model(x).square().mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(std_model.parameters(), model.parameters()))

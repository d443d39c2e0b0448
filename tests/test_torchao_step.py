"""The step of torchao's Adam classes in a bucket (``_direct_steps.TorchaoAdamStep``): torchao's own per-tensor function
compiled once per process, called with the arguments torchao's ``_AdamBase.step`` gives it, instead of a new
``torch.compile`` wrapper per tensor and step. Bitwise torchao's own standard loop (parameters, quantised states,
losses) in one bucket, several buckets and per parameter, across an LR schedule and a state-dict round trip; and
torchao's own step wherever the precondition (torchao 0.11.*, a class that keeps ``_AdamBase.step``) fails."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import dist_optim
from dist_optim.engine._direct_steps import (
    TorchaoAdamStep,
    torchao_adam_function,
    torchao_version,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim import adam as torchao_adam  # noqa: E402

pytestmark = pytest.mark.skipif(torchao_adam_function(torchao_optim.AdamW8bit, torchao_version()) is None,
                                reason=f"the path is written for torchao 0.11.*, this is {torchao_version()}")

CLASSES = ["AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit"]
MODES = {
    "one_bucket": {"bucket_cap_mb": float("inf")},
    "buckets": {"bucket_cap_mb": 1e-4},  # each autograd node's gradients a bucket of their own
    "per_parameter": {"per_parameter": True},
}
# weight decay as benchmarks/bench_bytes_per_param.py and test_reordered_draws.py: one compiled graph a shape for all
KWARGS = {"lr": 1e-2, "weight_decay": 0.01}
STEPS = 4


class Model(nn.Module):
    """Weights of 4096 elements (torchao's quantised states), biases under that (plain fp32 states), and a layer
    that never gets a gradient (skipped by both loops)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(dtype)
        self.unused = nn.Linear(64, 64).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.to(self.layers[0].weight.dtype)).float().square().mean()


def _class(name: str) -> type:
    return getattr(torchao_optim, name)


def _own(cls: type, model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    """torchao's own optimizer on ``model``, skipping where its compiled step does not build on this machine."""
    opt = cls(model.parameters(), **kwargs)
    probe = copy.deepcopy(model)
    try:
        probe_opt = cls(probe.parameters(), **kwargs)
        probe(torch.ones(2, 64)).backward()
        probe_opt.step()
    except Exception as e:  # noqa: BLE001 - e.g. fp8 states where inductor cannot compile them on this CPU
        pytest.skip(f"{cls.__name__}'s own loop fails here: {type(e).__name__}: {str(e)[:200]}")
    return opt


def _steppers(opt) -> list:
    return [i for b in opt._engine.buckets for i in b.inners]


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer, pa: list, pb: list) -> None:
    """Bitwise equal states, parameter by parameter, a quantised state's inner tensors (codes, scales) one by one."""
    for k, (p, q) in enumerate(zip(pa, pb, strict=True)):
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        assert sa.keys() == sb.keys(), k
        for key, x in sa.items():
            y = sb[key]
            assert type(x) is type(y), (k, key, type(x), type(y))
            if hasattr(type(x), "__tensor_flatten__"):
                names, attrs = x.__tensor_flatten__()
                assert attrs == y.__tensor_flatten__()[1], (k, key)
                pairs = [(getattr(x, n), getattr(y, n)) for n in names]
            else:
                pairs = [(x, y)]
            for u, v in pairs:  # compared as bytes (fp8 codes)
                assert u.dtype == v.dtype and u.shape == v.shape, (k, key)
                assert torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (k, key)


def _same(model: nn.Module, ref: nn.Module, opt, ref_opt) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    _same_state(opt, ref_opt, list(model.parameters()), list(ref.parameters()))


def _step_both(model: nn.Module, ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One step of torchao's own loop on ``ref`` and one in-backward step of ``model``, on the same batch."""
    ref(x).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    model(x).backward()


def _copy(value):
    """A deep copy that quantised states survive (torchao's subclasses have no clone)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CLASSES)
def test_bucket_step_equals_torchaos_own_loop(name, mode):
    """Several steps with an LR schedule (torchao's lr is a tensor, which the scheduler fills in place)."""
    cls = _class(name)
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = _own(cls, ref, **KWARGS)
    ref_lr = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    opt = dist_optim.InBackwardOptimizer(model, cls, **KWARGS, **MODES[mode])
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(4, 64, generator=g)
        loss_ref = ref(x)
        loss_ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_lr.step()
        loss = model(x)
        loss.backward()
        lr.step()
        assert torch.equal(loss, loss_ref)
    assert torch.equal(opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5**STEPS)  # the schedule reached the step
    _same(model, ref, opt, ref_opt)
    assert any("OptimState" in type(v).__name__ for s in opt.state.values() for v in s.values()), "not quantised"
    inners = _steppers(opt)  # built for the buckets that got gradients (the unused layer's never do)
    assert len(inners) == (1 if mode == "one_bucket" else 4) and all(isinstance(i.step, TorchaoAdamStep)
                                                                      for i in inners)
    # torchao's own step creates the state at the first step; the function compiled once steps every later one
    assert [i.step.direct for i in inners] == [STEPS - 1] * len(inners)


def test_bf16_stochastic_rounding_in_one_bucket():
    """The stochastic-rounding flag torchao passes for bf16 parameters: in one bucket (the group's order) the draws
    are the standard loop's, and the global generator ends where that loop leaves it."""
    cls = torchao_optim.AdamW8bit
    kwargs = {**KWARGS, "bf16_stochastic_round": True}
    model = Model(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref_opt = _own(cls, ref, **kwargs)
    opt = dist_optim.InBackwardOptimizer(model, cls, **kwargs, bucket_cap_mb=float("inf"))
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        rng = torch.get_rng_state()
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        after = torch.get_rng_state()
        assert not torch.equal(after, rng), "the standard loop drew nothing: stochastic rounding is off"
        torch.set_rng_state(rng)
        model(x).backward()
        assert torch.equal(torch.get_rng_state(), after), "the step drew other random numbers"
    _same(model, ref, opt, ref_opt)
    (inner,) = _steppers(opt)
    assert inner.step.direct == 2


def test_amsgrad():
    """``max_exp_avg_sq``, passed where amsgrad keeps it: on tensors under 4096 elements (plain fp32 states; on
    quantised states torchao's own amsgrad step does not compile on CPU). Two weights of one shape: one graph."""
    _own(torchao_optim.AdamW8bit, Model(), **KWARGS)  # skips where torchao's compiled step does not build
    cls = torchao_optim.AdamW8bit
    kwargs = {**KWARGS, "amsgrad": True}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False))
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **kwargs)
    opt = dist_optim.InBackwardOptimizer(model, cls, **kwargs, bucket_cap_mb=1e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).square().mean().backward()
    _same(model, ref, opt, ref_opt)
    assert all("max_exp_avg_sq" in s for s in opt.state.values())
    inners = _steppers(opt)
    assert len(inners) > 1 and all(isinstance(i.step, TorchaoAdamStep) and i.step.direct == 2 for i in inners)


def test_more_shapes_than_dynamos_recompile_limit():
    """One compiled function meets one shape per tensor. Where it compiles them (a resumed run: the state exists
    before its first step), past dynamo's limit of graphs per function it would fail (``fullgraph=True``) unless
    the limit is lifted, as torchao's own step lifts it. The limit is lowered to 2 here (8 by default): 4 shapes
    pass it, each a graph to compile."""
    _own(torchao_optim.AdamW8bit, Model(), **KWARGS)  # skips where torchao's compiled step does not build
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=2):
        _more_shapes_than_the_limit()


def _more_shapes_than_the_limit() -> None:
    cls = torchao_optim.AdamW8bit
    torch.manual_seed(0)
    shapes = range(3, 3 + torch._dynamo.config.recompile_limit + 2)
    model = nn.Sequential(*[nn.Linear(k, k + 1, bias=False) for k in shapes])
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **KWARGS)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, generator=g)
    ref(x).square().mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    opt = dist_optim.InBackwardOptimizer(model, cls, **KWARGS, per_parameter=True)
    opt.load_state_dict(_copy(ref_opt.state_dict()))  # a checkpoint of the standard loop
    torch._dynamo.reset()  # nothing compiled yet in this process: the bucket steps compile every shape
    for _ in range(2):
        x = torch.randn(2, 3, generator=g)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _same(model, ref, opt, ref_opt)
    inners = _steppers(opt)
    assert len(inners) == len(shapes) and all(i.step.direct == 2 for i in inners)


@pytest.mark.parametrize("mode", ["buckets", "per_parameter"])
def test_state_dict_round_trip_mid_run(mode):
    """Two steps, ``state_dict()`` saved and loaded into a new optimizer on the model, two more steps: torchao's own
    loop of four steps. The resumed one takes the compiled function from its first step (the state exists)."""
    cls = torchao_optim.AdamW4bit
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = _own(cls, ref, **KWARGS)
    opt = dist_optim.InBackwardOptimizer(model, cls, **KWARGS, **MODES[mode])
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:  # a new process would start from these: a copy of the model, the state dict saved
            saved = _copy(opt.state_dict())
            model = copy.deepcopy(model)
            opt = dist_optim.InBackwardOptimizer(model, cls, **KWARGS, **MODES[mode])
            opt.load_state_dict(saved)
        _step_both(model, ref, ref_opt, torch.randn(4, 64, generator=g))
    _same(model, ref, opt, ref_opt)
    inners = _steppers(opt)
    assert len(inners) == 4 and all(isinstance(i.step, TorchaoAdamStep) and i.step.direct == 2 for i in inners)


def test_a_subclass_that_overrides_step_takes_its_own_step():
    class Own(torchao_optim.AdamW8bit):  # its step may do anything: never replaced
        def step(self, closure=None):
            return super().step(closure)

    class Same(torchao_optim.AdamW8bit):  # keeps torchao's step
        pass

    assert torchao_adam_function(Own, torchao_version()) is None
    assert torchao_adam_function(Same, torchao_version()) is torchao_adam.single_param_adam
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = _own(Own, ref, **KWARGS)
    opt = dist_optim.InBackwardOptimizer(model, Own, **KWARGS, bucket_cap_mb=1e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        _step_both(model, ref, ref_opt, torch.randn(4, 64, generator=g))
    _same(model, ref, opt, ref_opt)
    assert _steppers(opt) and not any(isinstance(i.step, TorchaoAdamStep) for i in _steppers(opt))


@pytest.mark.parametrize("version", ["0.11.0", "0.11", "0.11.1+cu126", "0.11.0.dev20250401"])
def test_the_gate_opens_on_torchao_0_11(version):
    for name in CLASSES + ["Adam4bit", "AdamFp8", "_AdamW"]:
        assert torchao_adam_function(_class(name) if name != "_AdamW" else torchao_adam._AdamW, version) is (
            torchao_adam.single_param_adam), name


@pytest.mark.parametrize("version", ["0.12.0", "0.10.0", "0.110.0", "1.11.0", "0.1", None])
def test_the_gate_is_shut_on_other_torchao_versions(version):
    # another torchao's _AdamBase.step may pass other arguments, or step otherwise: its own step, whole
    assert torchao_adam_function(torchao_optim.AdamW8bit, version) is None


def test_the_gate_is_shut_on_other_classes():
    import torchao

    v = torchao_version()
    assert v == torchao.__version__
    for cls in (torch.optim.AdamW, torch.optim.Adam, nn.Linear, torchao_adam._AdamBase.__mro__[1]):
        assert torchao_adam_function(cls, v) is None, cls
    assert torchao_adam_function(torchao_adam._AdamBase, v) is torchao_adam.single_param_adam


def test_a_float_lr_takes_torchaos_step_and_its_error():
    """torchao refuses an lr that is no longer a tensor; the bucket's step hands it to torchao's step, which says so."""
    _own(torchao_optim.AdamW8bit, Model(), **KWARGS)  # skips where torchao's compiled step does not build
    model = Model()
    opt = dist_optim.InBackwardOptimizer(model, torchao_optim.AdamW8bit, **KWARGS, bucket_cap_mb=float("inf"))
    model(torch.ones(2, 64)).backward()  # creates the state
    opt.param_groups[0]["lr"] = 1e-3
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="lr was changed to a non-Tensor"):
        model(torch.ones(2, 64)).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    (inner,) = _steppers(opt)
    assert inner.step.direct == 0

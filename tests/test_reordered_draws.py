"""``random_draws="reordered"``: a class whose tensors' steps draw random numbers (torchao's
``bf16_stochastic_round=True``) is refused per bucket by default, with a message naming the option, and accepted
with it when its probes show that the draws' order is the only difference, never when the step couples tensors.

With the option, what is exact is asserted bitwise: the run equals the standard loop stepping the tensors in the
order backward steps them (one optimizer over the parameters in that order: the class steps each tensor on its own,
so that loop is the in-backward one but for the draws each tensor gets), and the global generator ends where the
plain standard loop's does (the same number of draws). Against the plain standard loop the parameters differ as
standard loops from different seeds differ from each other.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

import dist_optim
from launch.optimizers import plain_tensors

KW = {"lr": 1e-3, "bf16_stochastic_round": True}  # the benchmark's lr: steps of about one bf16 ulp
STEPS = 4


def _adamw8bit() -> type:
    """torchao's AdamW8bit, skipped where torchao is missing or its compiled step cannot be built here, on the
    model's tensors or on the probes shaped like them (inductor's code for a CPU capability it cannot target:
    ``ATEN_CPU_CAPABILITY=default``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = pytest.importorskip("torchao.optim").AdamW8bit
        try:
            with torch.random.fork_rng(devices=[]):
                for shape in ((64, 64), (6, 6)):
                    p = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
                    p.grad = torch.ones_like(p)
                    cls([p], **KW).step()
        except Exception as e:  # noqa: BLE001 - the class's own loop cannot run here
            pytest.skip(f"torchao's own loop fails here: {type(e).__name__}: {str(e)[:200]}")
    return cls


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    """Bias-free layers of one shape (one compiled torchao step; 4096 elements: 8-bit states): backward's order is
    the parameters' reversed, each tensor a bucket of its own with ``per_parameter=True``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False), nn.Tanh(),
                         nn.Linear(64, 64, bias=False)).to(dtype)


def _data(n: int = STEPS, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 64, generator=g).to(dtype) for _ in range(n)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], seed: int = 7,
           orders: list[list[int]] | None = None) -> torch.Tensor:
    """The same loop for both optimizers (the in-backward one steps in backward); the generator's end state.
    ``orders``: before each step, the standard optimizer's tensors put in that order (indices of the model's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    params = list(model.parameters())
    for k, x in enumerate(data):
        if orders is not None:
            opt.param_groups[0]["params"] = [params[i] for i in orders[k]]
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.get_rng_state()


def _stepping_order(model: nn.Module, opt: dist_optim.InBackwardOptimizer) -> list[list[int]]:
    """Filled as ``opt`` steps: for each training step, the indices of the model's parameters in the order their
    buckets were stepped."""
    index = {id(p): k for k, p in enumerate(model.parameters())}
    orders: list[list[int]] = []

    def stepped(_, params: list[torch.Tensor]) -> None:
        if not orders or len(orders[-1]) == len(index):
            orders.append([])
        orders[-1].extend(index[id(p)] for p in params)

    opt.register_bucket_step_hook(stepped)
    return orders


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every state tensor (a quantised state's codes, scales and code map), parameter by parameter."""
    return [x for p in params for _, v in sorted(opt.state[p].items()) for x in plain_tensors(v)]


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """The largest elementwise difference, and the share of elements that differ."""
    biggest = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    share = sum(int((x != y).sum()) for x, y in zip(a, b)) / sum(x.numel() for x in a)
    return biggest, share


# -- torchao's stochastic rounding -------------------------------------------------------------------------------
def test_stochastic_rounding_is_refused_per_bucket_naming_the_option():
    cls = _adamw8bit()
    model = _model()
    before, rng = _params(model), torch.get_rng_state()
    with pytest.raises(NotImplementedError, match=r"AdamW8bit cannot be stepped one bucket at a time exactly: each "
                       r"tensor's step draws random numbers.*Pass random_draws='reordered'"):
        dist_optim.InBackwardOptimizer(model, cls, per_parameter=True, **KW)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())  # the probes drew nothing from the user's stream
    dist_optim.InBackwardOptimizer(model, cls, bucket_cap_mb=float("inf"), **KW)  # one step: exact, accepted


def test_with_the_option_the_draws_are_the_standard_loops_in_backwards_order():
    cls = _adamw8bit()
    data = _data()
    model = _model()
    opt = dist_optim.InBackwardOptimizer(model, cls, per_parameter=True, random_draws="reordered", **KW)
    assert opt.options.random_draws == "reordered"
    orders = _stepping_order(model, opt)
    ended = _train(model, opt, data)
    assert orders == [[2, 1, 0]] * STEPS  # backward's, which the exact reference below steps in

    # exact: the standard loop over the tensors in backward's order
    ref_model = _model()
    ref = cls(ref_model.parameters(), **KW)
    assert torch.equal(_train(ref_model, ref, data, orders=orders), ended)
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    mine = [p for p in model.parameters()]
    assert len(_state(ref, list(ref_model.parameters()))) == len(_state(opt, mine)) > 3 * len(mine)  # codes, scales
    assert all(torch.equal(a, b) for a, b in zip(_state(ref, list(ref_model.parameters())), _state(opt, mine)))

    # against the plain standard loop: the same draws (the generator ends in the same state), for other tensors
    std_model = _model()
    std = cls(std_model.parameters(), **KW)
    assert torch.equal(_train(std_model, std, data), ended)
    std_params = _params(std_model)
    biggest, share = _difference(_params(model), std_params)
    assert biggest > 0 and share > 0  # reordered draws: not the same run
    # as far apart as standard loops from other seeds are from it: the largest of three such differences
    spread = []
    for seed in (8, 9, 10):
        other_model = _model()
        _train(other_model, cls(other_model.parameters(), **KW), data, seed=seed)
        spread.append(_difference(_params(other_model), std_params))
    assert biggest <= max(s[0] for s in spread) and share <= max(s[1] for s in spread), (biggest, share, spread)


def test_fp32_parameters_draw_nothing_and_stay_exact_with_the_option():
    """torchao rounds stochastically only bf16 parameters: in fp32 the option changes nothing (bitwise)."""
    cls = _adamw8bit()
    data = _data(2, dtype=torch.float32)
    model, ref_model = _model(torch.float32), _model(torch.float32)
    opt = dist_optim.InBackwardOptimizer(model, cls, per_parameter=True, random_draws="reordered", **KW)
    ref = cls(ref_model.parameters(), **KW)
    assert torch.equal(_train(model, opt, data), _train(ref_model, ref, data))
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))


# -- the rule, on classes written here ---------------------------------------------------------------------------
class NoisySGD(torch.optim.Optimizer):
    """SGD with Gaussian noise drawn per tensor from torch's global generator (as stochastic rounding draws)."""

    def __init__(self, params, lr=0.1, noise=0.01):
        super().__init__(params, {"lr": lr, "noise": noise})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad + group["noise"] * torch.randn_like(p), alpha=-group["lr"])


class PythonNoisySGD(NoisySGD):
    """The same, one draw per tensor from Python's ``random``."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad + random.gauss(0.0, group["noise"]), alpha=-group["lr"])


class OneDrawPerCallSGD(NoisySGD):
    """One draw per ``step()`` call, shared by all tensors: stepped per bucket it draws once per bucket."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = 1 + group["noise"] * torch.rand(())
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * scale, alpha=-group["lr"])


class NoisyGlobalNormSGD(NoisySGD):
    """Noise per tensor and a step scaled by the group's gradient norm: couples tensors beyond the draws."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = torch.stack([p.grad.norm() for p in group["params"] if p.grad is not None]).norm()
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm + group["noise"] * torch.randn_like(p), alpha=-group["lr"])


class OwnStepSGD(NoisySGD):
    """A step of its own (checked by behaviour) that draws nothing."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("cls", [NoisySGD, PythonNoisySGD])
def test_draws_from_torch_or_python_are_reordered_and_equal_the_loop_in_backwards_order(cls):
    data = _data(3, dtype=torch.float32)
    model = _model(torch.float32)
    with pytest.raises(NotImplementedError, match="random_draws='reordered'"):
        dist_optim.InBackwardOptimizer(model, cls, per_parameter=True)
    opt = dist_optim.InBackwardOptimizer(model, cls, per_parameter=True, random_draws="reordered")
    orders = _stepping_order(model, opt)
    ended = _train(model, opt, data), random.getstate()
    assert orders == [[2, 1, 0]] * 3
    ref_model = _model(torch.float32)
    ref = cls(ref_model.parameters())
    assert _train(ref_model, ref, data, orders=orders).equal(ended[0]) and random.getstate() == ended[1]
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    std_model = _model(torch.float32)
    _train(std_model, cls(std_model.parameters()), data)
    assert random.getstate() == ended[1]
    assert not all(torch.equal(a, b) for a, b in zip(std_model.parameters(), model.parameters()))


@pytest.mark.parametrize("cls", [OneDrawPerCallSGD, NoisyGlobalNormSGD])
def test_a_step_that_depends_on_more_than_the_draws_order_stays_refused_with_the_option(cls):
    model = _model(torch.float32)
    messages = []
    for draws in ("exact", "reordered"):
        with pytest.raises(NotImplementedError) as e:
            dist_optim.InBackwardOptimizer(model, cls, per_parameter=True, random_draws=draws)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "random_draws" not in messages[0]
    assert f"{cls.__qualname__} cannot be stepped one bucket at a time: its parameters differ" in messages[0]
    dist_optim.InBackwardOptimizer(model, cls, bucket_cap_mb=float("inf"), random_draws="reordered")


@pytest.mark.parametrize("name", ["AdamS", "Kron"])
def test_pytorch_optimizers_coupled_classes_stay_refused_with_the_option(name):
    """AdamS scales its weight decay by a mean over the group (a difference of 1e-7 relative at lr=1e-3, which the
    probes' gradients of three scales make show: before them a model of three equal matrices was accepted and
    trained otherwise); Kron draws once per step() call (numpy's balance decision) besides its per-tensor draws.
    Neither is its standard step when stepped one tensor per bucket in the group's order: refused alike either way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(pytest.importorskip("pytorch_optimizer"), name)
    messages = []
    for draws in ("exact", "reordered"):
        with pytest.raises(NotImplementedError, match=f"{name} cannot be stepped one bucket at a time: its "
                                                      "parameters differ") as e:
            dist_optim.InBackwardOptimizer(_model(torch.float32), cls, lr=1e-3, per_parameter=True,
                                           random_draws=draws)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "random_draws" not in messages[0]


def test_a_class_without_draws_is_exact_either_way():
    data = _data(2, dtype=torch.float32)
    ref_model = _model(torch.float32)
    _train(ref_model, OwnStepSGD(ref_model.parameters()), data)
    for draws in ("exact", "reordered"):
        model = _model(torch.float32)
        _train(model, dist_optim.InBackwardOptimizer(model, OwnStepSGD, per_parameter=True, random_draws=draws), data)
        assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))


def test_the_option_is_checked_where_it_is_built():
    with pytest.raises(ValueError, match="random_draws must be one of 'exact', 'reordered', got 'any'"):
        dist_optim.InBackwardOptions(random_draws="any")
    options = dist_optim.InBackwardOptions(random_draws="reordered", per_parameter=True)
    dist_optim.InBackwardOptimizer(_model(torch.float32), NoisySGD, options=options)


# -- DDP and FSDP2, 2 gloo ranks ------------------------------------------------------------------------------------
def _ddp_scenario(ctx, torchao: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    cls, kwargs, dtype = (_adamw8bit(), KW, torch.bfloat16) if torchao else (NoisySGD, {}, torch.float32)
    data = _data(3, seed=10 + ctx.rank, dtype=dtype)  # each rank its own batches
    for flag in ("find_unused_parameters", "static_graph"):
        refused = DDP(_model(dtype), bucket_cap_mb=1e-4, **{flag: True})
        with pytest.raises(NotImplementedError, match=r"random_draws='reordered' needs every rank to step the "
                           r"tensors in one order.*find_unused_parameters=True\) or static_graph=True"):
            dist_optim.InBackwardOptimizer(refused, cls, random_draws="reordered", **kwargs)
        assert not any(p._post_accumulate_grad_hooks for p in refused.parameters())
        dist_optim.InBackwardOptimizer(refused, torch.optim.SGD, lr=0.1)  # DDP takes one comm hook: none was left
    ignoring = _model(dtype)
    DDP._set_params_and_buffers_to_ignore_for_model(ignoring, ["0.weight"])
    with pytest.raises(NotImplementedError, match="'0.weight' and 0 more are parameters DDP ignores"):
        dist_optim.InBackwardOptimizer(DDP(ignoring, bucket_cap_mb=1e-4), cls, random_draws="reordered", **kwargs)
    # DDP's first iteration reduces one bucket (stepped in the group's order), then each parameter a bucket of its
    # own, stepped in backward's order: the same on every rank
    model = DDP(_model(dtype), bucket_cap_mb=1e-4)
    opt = dist_optim.InBackwardOptimizer(model, cls, random_draws="reordered", **kwargs)
    orders = _stepping_order(model, opt)
    ended = _train(model, opt, data)
    assert orders == [[0, 1, 2], [2, 1, 0], [2, 1, 0]], orders
    ref_model = DDP(_model(dtype), bucket_cap_mb=1e-4)
    ref = cls(ref_model.parameters(), **kwargs)
    assert torch.equal(_train(ref_model, ref, data, orders=orders), ended)
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    mine = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    torch.distributed.all_gather(every, mine)
    assert all(torch.equal(every[0], x) for x in every)  # the replicas stay identical
    return "exact"


def test_ddp_steps_every_rank_in_one_order_and_equals_its_loop_in_that_order(ranks):
    """torchao's stochastic rounding where torchao is installed, else a class written here that draws alike."""
    try:
        _adamw8bit()
        torchao = True
    except pytest.skip.Exception:
        torchao = False
    assert ranks.run(2, _ddp_scenario, torchao=torchao) == ["exact", "exact"]


def _fsdp2_scenario(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(torch.float32)
    mesh = init_device_mesh("cpu", (ctx.world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(NotImplementedError, match="on DTensor parameters .FSDP2, tensor parallel."):
        dist_optim.InBackwardOptimizer(model, NoisySGD, random_draws="reordered")
    return "refused"


def test_fsdp2_is_refused_with_the_reason(ranks):
    assert ranks.run(2, _fsdp2_scenario) == ["refused", "refused"]

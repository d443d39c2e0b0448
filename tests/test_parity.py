"""Parity matrix: every closure-free ``torch.optim`` optimizer stepped in backward equals the standard loop.

For each optimizer configuration, implementation (for-loop, foreach, fused, and the default that
``InBackwardOptimizer`` picks), main option (weight decay, maximize, tensor lr) and engine mode (one bucket,
per-parameter, tiny buckets, a parameter whose gradient does not arrive in some iterations), two copies of the same
model are trained from the same seed on the same data:

* the standard loop ``loss.backward(); opt.step(); opt.zero_grad()`` with the torch optimizer itself;
* ``InBackwardOptimizer`` with the same class, options and implementation, where ``loss.backward()`` steps.

After every iteration the losses, every parameter and every ``state_dict()["state"]`` entry must be bitwise equal
(``torch.equal``, same dtype). Bitwise equality is expected everywhere here: every torch optimizer's kernels
(for-loop, foreach and fused alike; Muon's Newton-Schulz and Adafactor's factored second moment included) compute
each parameter from that parameter's own gradient and state only, so splitting a group into buckets changes neither
the operations nor their order for any element. No tolerance is used anywhere.

Two places that need a word is not the plain reference, each pinned by its own test below:

* torch's fused SGD with momentum crashes on a parameter whose first gradient comes after the others' (the
  ``unused_late`` mode), so that reference gives the parameter its own group;
* torch's Adagrad creates its state in ``__init__``: so must ``InBackwardOptimizer``, for every parameter, before
  any gradient arrives.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from dist_optim import InBackwardOptimizer

optim = torch.optim

IN_DIM, HIDDEN, OUT_DIM, BATCH = 6, 8, 3, 5
STEPS = 5


# ---------------------------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------------------------
class Net(nn.Module):
    """Small MLP with a LayerNorm (9 tensors of 6 shapes), or only bias-free matrices (4 tensors) for Muon.

    ``extra`` is a side branch; the loop leaves it out of the forward in some iterations, so its gradient never
    arrives there.
    """

    def __init__(self, matrices_only: bool) -> None:
        super().__init__()
        bias = not matrices_only
        self.fc1 = nn.Linear(IN_DIM, HIDDEN, bias=bias)
        self.norm = nn.LayerNorm(HIDDEN, elementwise_affine=not matrices_only)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN, bias=bias)
        self.fc3 = nn.Linear(HIDDEN, OUT_DIM, bias=bias)
        self.extra = nn.Linear(IN_DIM, OUT_DIM, bias=False)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        out = self.fc3(h)
        if use_extra:
            out = out + self.extra(x)
        return out


def make_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, IN_DIM, generator=g), torch.randn(BATCH, OUT_DIM, generator=g)) for _ in range(steps)]


def loss_fn(model: Net, batch: tuple[torch.Tensor, torch.Tensor], use_extra: bool) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x, use_extra), y)


# ---------------------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------------------
# torch implements ``fused`` on CPU for these four classes only; the others take ``foreach`` (or neither: Muon).
FUSED_ON_CPU = (optim.SGD, optim.Adam, optim.AdamW, optim.Adagrad)


@dataclass(frozen=True)
class Config:
    id: str
    cls: type[optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = STEPS
    # Muon only: "matrices" = a model of bias-free matrices, all given to Muon; "mixed" = the MLP with the matrices
    # in a Muon group and everything else in a group with "optimizer_class": torch.optim.AdamW.
    muon: str | None = None


CONFIGS = [
    Config("SGD", optim.SGD, dict(lr=0.05)),
    Config("SGD-momentum", optim.SGD, dict(lr=0.05, momentum=0.9)),
    Config("SGD-nesterov", optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    Config("SGD-dampening", optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    Config("Adam", optim.Adam, dict(lr=0.01)),
    Config("Adam-amsgrad", optim.Adam, dict(lr=0.01, amsgrad=True)),
    Config("AdamW", optim.AdamW, dict(lr=0.01)),
    Config("Adamax", optim.Adamax, dict(lr=0.01)),
    Config("Adagrad", optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    Config("Adadelta", optim.Adadelta, dict(lr=0.5)),
    Config("RMSprop", optim.RMSprop, dict(lr=0.01)),
    Config("RMSprop-centered", optim.RMSprop, dict(lr=0.01, centered=True)),
    Config("RMSprop-momentum", optim.RMSprop, dict(lr=0.01, momentum=0.9)),
    Config("Rprop", optim.Rprop, dict(lr=0.01)),
    Config("NAdam", optim.NAdam, dict(lr=0.01)),
    Config("NAdam-decoupled", optim.NAdam, dict(lr=0.01, decoupled_weight_decay=True)),
    # RAdam switches to its rectified update once rho_t > 5, which with beta2 = 0.999 happens from step 6 on:
    # 8 steps cover both branches.
    Config("RAdam", optim.RAdam, dict(lr=0.01), steps=8),
    Config("RAdam-decoupled", optim.RAdam, dict(lr=0.01, decoupled_weight_decay=True), steps=8),
    # t0=2 starts the averaging (state "ax", "mu" != 1) within the run.
    Config("ASGD", optim.ASGD, dict(lr=0.01, t0=2)),
    Config("Adafactor", optim.Adafactor, dict(lr=0.01)),
    Config("Muon", optim.Muon, dict(lr=0.02), muon="matrices"),
    Config("Muon+AdamW", optim.Muon, dict(lr=0.02), muon="mixed"),
]

# The group the AdamW side of "Muon+AdamW" gets (its options come from the group dict, not the Muon kwargs).
ADAMW_SIDE = dict(lr=0.01, weight_decay=0.02)


def _accepts(cls: type[optim.Optimizer], name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def implementations(cfg: Config) -> list[str]:
    """The implementations torch offers for ``cfg`` on CPU, plus "default" (the user sets neither flag)."""
    cls = optim.AdamW if cfg.muon == "mixed" else cfg.cls  # Muon has no foreach/fused: the AdamW side varies
    impls = ["default"]
    if _accepts(cls, "foreach"):
        impls += ["forloop", "foreach"]
    if cls in FUSED_ON_CPU:
        impls.append("fused")
    return impls


def impl_flags(cls: type[optim.Optimizer], impl: str, *, reference: bool) -> dict[str, Any]:
    """Options that select ``impl``. For "default" the in-backward optimizer gets nothing, and the reference gets
    what it must pick: fused where torch has it on CPU (except SGD), else foreach, else nothing (Muon)."""
    if not (_accepts(cls, "foreach") or _accepts(cls, "fused")):
        return {}  # Muon: one implementation (the Muon group of "Muon+AdamW" while its AdamW group varies)
    if impl == "default":
        if not reference:
            return {}
        if cls in FUSED_ON_CPU and cls is not optim.SGD:
            return {"fused": True}
        # SGD: dist_optim deliberately never auto-picks fused SGD (torch's fused SGD fails on a group where some
        # momentum buffers exist and some not yet, see test_torch_fused_sgd_fails_on_a_late_first_gradient), so its
        # default is foreach like the classes without fused.
        return {"foreach": True} if _accepts(cls, "foreach") else {}
    if impl == "forloop":
        return {"foreach": False, **({"fused": False} if _accepts(cls, "fused") else {})}
    return {impl: True}


OPTIONS = {
    "plain": {},
    "wd": {"weight_decay": 0.05},
    "maximize": {"maximize": True},
    # A fresh tensor per optimizer (see optimizer_kwargs): nothing is shared between the two runs.
    "tensor_lr": {"lr": "tensor"},
}


def optimizer_kwargs(cfg: Config, option: str) -> dict[str, Any]:
    """The configuration's options with ``option`` applied on top."""
    kw = {**cfg.kwargs, **OPTIONS[option]}
    if kw.get("lr") == "tensor":
        kw["lr"] = torch.tensor(cfg.kwargs["lr"])
    return kw


def excluded(cfg: Config, impl: str, option: str) -> bool:
    """Combinations torch itself refuses; test_excluded_combinations_are_refused_by_torch keeps this list honest."""
    main_cls = cfg.cls
    # Rprop has no weight_decay ("Rprop.__init__() got an unexpected keyword argument 'weight_decay'").
    if option == "wd" and not _accepts(main_cls, "weight_decay"):
        return True
    # Muon has no maximize ("Muon.__init__() got an unexpected keyword argument 'maximize'").
    if option == "maximize" and not _accepts(main_cls, "maximize"):
        return True
    # Adam/AdamW: "lr as a Tensor is not supported for capturable=False and foreach=True" (CPU has no capturable).
    if option == "tensor_lr" and impl == "foreach" and main_cls in (optim.Adam, optim.AdamW):
        return True
    return False


MODES = {
    # name: (InBackwardOptimizer engine kwargs, which iterations use the `extra` branch; None = all)
    # All gradients (9 for the MLP, 4 for the matrices-only model) fill one bucket, stepped when backward ends.
    "one_bucket": ({}, None),
    "per_param": ({"per_parameter": True}, None),
    # 1e-4 MiB = 104 bytes = 26 float32: three buckets of 2-4 tensors form, each stepped inside backward as soon
    # as its last gradient arrives ([extra.weight, fc3.*], [fc2.*], [norm.*, fc1.*] for the MLP).
    "tiny_buckets": ({"bucket_cap_mb": 1e-4}, None),
    # `extra` is used in the first iteration (so it is placed in a bucket), then missing every other iteration:
    # its bucket never completes and is stepped at the end of backward with one gradient absent ...
    "unused_gap": ({}, (True, False) * 4),
    # ... the same where that bucket is one of several (the others complete and step inside backward) ...
    "unused_gap_tiny": ({"bucket_cap_mb": 1e-4}, (True, False) * 4),
    # ... and where it is a bucket of its own that none of its gradients reach, so it is not stepped at all.
    "unused_gap_per_param": ({"per_parameter": True}, (True, False) * 4),
    # `extra` unused in the first two iterations: it joins a bucket only when its gradient first arrives.
    "unused_late": ({}, (False, False, True, False, True, True, False, True)),
}

MIXED_MODES = ("per_param", "tiny_buckets", "unused_gap", "unused_gap_tiny", "unused_gap_per_param", "unused_late")


def _cases() -> list[Any]:
    cases = []
    for cfg in CONFIGS:
        for impl in implementations(cfg):
            # every option with one bucket; every other engine mode with weight decay (plain where the class has
            # none), which would show at once if a parameter without a gradient were stepped
            wd = "plain" if excluded(cfg, impl, "wd") else "wd"
            combos = [(option, "one_bucket") for option in OPTIONS] + [(wd, mode) for mode in MIXED_MODES]
            cases += [
                pytest.param(cfg, impl, option, mode, id=f"{cfg.id}-{impl}-{option}-{mode}")
                for option, mode in combos
                if not excluded(cfg, impl, option)
            ]
    return cases


# ---------------------------------------------------------------------------------------------------------------
# Building the two optimizers
# ---------------------------------------------------------------------------------------------------------------
def split_params(model: Net, cfg: Config) -> list[list[str]]:
    """Parameter names per group: one group, or [matrices, the rest] for Muon+AdamW."""
    names = [n for n, _ in model.named_parameters()]
    if cfg.muon == "mixed":
        params = dict(model.named_parameters())
        return [[n for n in names if params[n].ndim == 2], [n for n in names if params[n].ndim != 2]]
    return [names]


def first_use_is_late(mode: str) -> bool:
    use_extra = MODES[mode][1]
    return use_extra is not None and not use_extra[0]


def build_reference(model: Net, cfg: Config, impl: str, option: str, mode: str) -> list[optim.Optimizer]:
    params = dict(model.named_parameters())
    groups = split_params(model, cfg)
    kwargs = {**optimizer_kwargs(cfg, option), **impl_flags(cfg.cls, impl, reference=True)}
    main_params: list[Any] = [params[n] for n in groups[0]]
    if cfg.cls is optim.SGD and kwargs.get("fused") and kwargs.get("momentum") and first_use_is_late(mode):
        # torch's own fused SGD cannot run this loop: once some momentum buffers of a group exist, a parameter
        # whose first gradient comes later makes it raise "expected Tensor as element 8 in argument 2, but got
        # NoneType" (see test_torch_fused_sgd_fails_on_a_late_first_gradient). Giving `extra` (the last parameter,
        # so the state_dict indices stay the same) a group of its own is the standard loop that runs: every
        # tensor's arithmetic is the same, only the group boundary moves.
        main_params = [{"params": main_params[:-1]}, {"params": main_params[-1:]}]
    main = cfg.cls(main_params, **kwargs)
    if cfg.muon != "mixed":
        return [main]
    side = optim.AdamW([params[n] for n in groups[1]], **ADAMW_SIDE, **impl_flags(optim.AdamW, impl, reference=True))
    return [main, side]


def build_in_backward(model: Net, cfg: Config, impl: str, option: str, mode: str) -> InBackwardOptimizer:
    params = dict(model.named_parameters())
    groups = split_params(model, cfg)
    engine_kwargs, _ = MODES[mode]
    if cfg.muon != "mixed":
        return InBackwardOptimizer([params[n] for n in groups[0]], cfg.cls, **engine_kwargs,
                                   **optimizer_kwargs(cfg, option), **impl_flags(cfg.cls, impl, reference=False))
    return InBackwardOptimizer(
        [
            {"params": [params[n] for n in groups[0]]},
            {"params": [params[n] for n in groups[1]], "optimizer_class": optim.AdamW, **ADAMW_SIDE,
             **impl_flags(optim.AdamW, impl, reference=False)},
        ],
        cfg.cls,
        **engine_kwargs,
        **optimizer_kwargs(cfg, option),
    )


# ---------------------------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------------------------
def assert_bitwise(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__} instead of a tensor"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
            f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
        )
        if not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{what} differs from the standard loop: max |diff| {diff:.3e}")
    else:
        assert actual == expected, f"{what}: {actual!r} vs {expected!r}"


def expected_state(ref_opts: list[optim.Optimizer]) -> dict[int, dict[str, Any]]:
    """The reference optimizers' state_dict()['state'], re-indexed as one optimizer holding all their params in
    order (the in-backward optimizer's groups list them in the same order)."""
    out: dict[int, dict[str, Any]] = {}
    offset = 0
    for opt in ref_opts:
        for k, v in opt.state_dict()["state"].items():
            out[offset + k] = v
        offset += sum(len(g["params"]) for g in opt.param_groups)
    return out


def assert_same_state(ibo: InBackwardOptimizer, ref_opts: list[optim.Optimizer], when: str) -> None:
    """Bitwise equal state_dict()["state"]: the same entries, keys, dtypes and values."""
    actual = ibo.state_dict()["state"]
    expected = expected_state(ref_opts)
    assert sorted(actual) == sorted(expected), (
        f"{when}: state kept for params {sorted(actual)}, standard loop {sorted(expected)}"
    )
    for k, exp in expected.items():
        assert sorted(actual[k]) == sorted(exp), f"{when}: state[{k}] keys {sorted(actual[k])} vs {sorted(exp)}"
        for key, value in exp.items():
            assert_bitwise(actual[k][key], value, f"{when}: state[{k}][{key!r}]")


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "impl", "option", "mode"), _cases())
def test_in_backward_matches_standard_loop(cfg: Config, impl: str, option: str, mode: str) -> None:
    torch.manual_seed(0)
    ref_model = Net(matrices_only=cfg.muon == "matrices")
    model = copy.deepcopy(ref_model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = make_data(cfg.steps)
    use_extra = MODES[mode][1] or (True,) * cfg.steps
    order = [n for group in split_params(model, cfg) for n in group]  # state_dict index -> parameter name

    ref_opts = build_reference(ref_model, cfg, impl, option, mode)
    ibo = build_in_backward(model, cfg, impl, option, mode)
    assert_same_state(ibo, ref_opts, "before training")

    ref_params = dict(ref_model.named_parameters())
    for it, batch in enumerate(data):
        used = [n for n in order if use_extra[it] or n != "extra.weight"]
        extra_before = model.extra.weight.detach().clone()

        ref_loss = loss_fn(ref_model, batch, use_extra[it])
        ref_loss.backward()
        for name in order:  # the loss reaches every element of every parameter in use, and nothing else
            grad = ref_params[name].grad
            assert (grad is not None and bool(grad.ne(0).all())) if name in used else grad is None, name
        for opt in ref_opts:
            opt.step()
        for opt in ref_opts:
            opt.zero_grad()

        loss = loss_fn(model, batch, use_extra[it])
        loss.backward()  # steps every parameter whose gradient arrives
        # The whole step ran inside backward: the gradients are consumed and the parameters already equal the
        # reference's after its step().
        for name, p in model.named_parameters():
            assert p.grad is None, f"iteration {it}: {name}.grad was left after backward"
            assert_bitwise(p.detach(), ref_params[name].detach(), f"iteration {it}: {name} right after backward")
        if not use_extra[it]:
            assert torch.equal(model.extra.weight, extra_before), f"iteration {it}: extra stepped without a grad"
        ibo.step()  # an unchanged loop still calls these; nothing is left for them to do
        ibo.zero_grad()

        assert_bitwise(loss.detach(), ref_loss.detach(), f"iteration {it}: loss")
        for name, p in model.named_parameters():
            assert_bitwise(p.detach(), ref_params[name].detach(), f"iteration {it}: {name}")
        assert_same_state(ibo, ref_opts, f"iteration {it}")

    # The run really trained (equality alone would also hold for two optimizers that do nothing).
    for name, p in model.named_parameters():
        assert not torch.equal(p, initial[name]), f"{name} never changed"


# Every combination `excluded()` leaves out, with the refusal torch gives for it.
REFUSED = [
    pytest.param(optim.Rprop, {"lr": 0.01, "weight_decay": 0.05}, "unexpected keyword argument 'weight_decay'",
                 id="Rprop-weight_decay"),
    pytest.param(optim.Muon, {"lr": 0.02, "maximize": True}, "unexpected keyword argument 'maximize'",
                 id="Muon-maximize"),
    pytest.param(optim.Adam, {"lr": torch.tensor(0.01), "foreach": True},
                 "lr as a Tensor is not supported for capturable=False and foreach=True", id="Adam-foreach-tensor_lr"),
    pytest.param(optim.AdamW, {"lr": torch.tensor(0.01), "foreach": True},
                 "lr as a Tensor is not supported for capturable=False and foreach=True", id="AdamW-foreach-tensor_lr"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), REFUSED)
def test_excluded_combinations_are_refused_by_torch(cls, kwargs, message) -> None:
    """The matrix skips these only because torch refuses them; the in-backward optimizer refuses them the same."""
    def standard() -> None:
        p = torch.zeros(2, 2, requires_grad=True)
        p.grad = torch.ones(2, 2)
        cls([p], **kwargs).step()

    with pytest.raises((TypeError, ValueError), match=message):
        standard()
    with pytest.raises((TypeError, ValueError), match=message):
        InBackwardOptimizer([torch.zeros(2, 2, requires_grad=True)], cls, **kwargs)


def test_torch_fused_sgd_fails_on_a_late_first_gradient() -> None:
    """Why build_reference gives `extra` its own group for fused SGD with momentum when its first gradient is late:
    torch's fused SGD treats a group as "first step" only if *no* momentum buffer exists yet. If torch fixes this,
    this test fails and the workaround can go."""
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = optim.SGD([a, b], lr=0.1, momentum=0.9, fused=True)
    a.grad = torch.ones(2)
    opt.step()
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    with pytest.raises(TypeError, match="expected Tensor as element 1 in argument 2, but got NoneType"):
        opt.step()


def test_adagrad_state_before_first_gradient() -> None:
    """A parameter no gradient has reached yet: torch.optim.Adagrad has state for it, so should the facade."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    # fused on both sides: torch's default on CPU is the for-loop, dist_optim's is fused, and the two differ in the
    # last bits on some CPUs (AMD EPYC)
    ref = optim.Adagrad([a, b], lr=0.1, initial_accumulator_value=0.5, fused=True)
    ibo = InBackwardOptimizer([a2, b2], optim.Adagrad, lr=0.1, initial_accumulator_value=0.5, fused=True)
    # torch: {0: {'step': tensor(0.), 'sum': 0.5s}, 1: {...}} at construction, and for b after a step of a alone
    (a.sum() * 2).backward()
    ref.step()
    ref.zero_grad()
    (a2.sum() * 2).backward()
    assert torch.equal(a, a2)
    assert sorted(ref.state_dict()["state"]) == [0, 1]
    assert sorted(ibo.state_dict()["state"]) == [0, 1]
    assert torch.equal(ibo.state_dict()["state"][1]["sum"], ref.state_dict()["state"][1]["sum"])

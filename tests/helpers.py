"""Shared test pieces: a small model, deterministic data, and the standard loop every feature is checked against."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable

import torch
from torch import nn

# -- constants shared by the test files (one place: change a setting here, every file follows) --------------------
# Every optimizer setting names its kernel (fused= or foreach=) so that both sides of a bitwise comparison run the
# same one: fused, foreach and for-loop kernels differ in the last bits on some CPUs (fused vs for-loop Adagrad on
# AMD EPYC). See tests/README.md.
ADAMW_HPARAMS = {"lr": 1e-2, "weight_decay": 0.1}  # for tests that choose the kernel themselves
ADAMW = {**ADAMW_HPARAMS, "fused": True}
SGD_MOMENTUM = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "foreach": True}
ADAGRAD = {"lr": 0.1, "foreach": True}
WIDTH = 16  # make_model(width=WIDTH) in the distributed tests: room for 4 shards per tensor
STEPS = 3  # optimizer steps per distributed parity scenario: enough for state (momentum, exp_avg) to matter
WORLD_SIZES = (2, 4)  # ranks of the distributed parity suites (HSDP needs 4: 2 replicas x 2 shards)
# A resume on another world size or wrapper changes the reduction order of the gradient mean: not bitwise.
RESHARD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# Seconds one distributed scenario may take before the runner dumps the ranks' stacks and kills them. A scenario
# takes 1-10 s; the margin is for a 2-core machine running `pytest -n 2` next to other work.
SCENARIO_TIMEOUT = 180.0


class MLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(**kwargs)


def batches(n: int, width: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, width, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train_standard(model: nn.Module, opt: torch.optim.Optimizer, data, after_step: Callable | None = None) -> list:
    losses = []
    for k, batch in enumerate(data):
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step(k, loss)
    return losses


def train_in_backward(model: nn.Module, data, after_step: Callable | None = None) -> list:
    losses = []
    for k, batch in enumerate(data):
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.item())
        if after_step is not None:
            after_step(k, loss)
    return losses


def twins(seed: int = 0, **kwargs) -> tuple[nn.Module, nn.Module]:
    model = make_model(seed, **kwargs)
    return model, copy.deepcopy(model)


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs: max |diff| {(p - q).abs().max().item()}"


def assert_same_state(sd_a: dict, sd_b: dict) -> None:
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k, state in sd_a["state"].items():
        assert state.keys() == sd_b["state"][k].keys()
        for key, v in state.items():
            w = sd_b["state"][k][key]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"state[{k}][{key!r}] differs"


def run_benchmark_quick(name: str, tmp_path, *args: str) -> tuple[dict, str]:
    """Run ``python -m benchmarks.<name> --quick [args]`` from the repository root in a subprocess; return its JSON
    result and its stderr."""
    import json
    import pathlib
    import subprocess
    import sys

    out = tmp_path / f"{name}.json"
    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out), *args], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


# -- torchao's compiled step, where it is not what a test is about --------------------------------------------------
# torchao's Adam classes compile their per-tensor step (inductor, one graph for each parameter shape, dtype and
# hyper-parameter set: 2-5 CPU-s each on a cold inductor cache, which is CI's every run). tests/test_torchao_step.py,
# the trainer's --optimizer adamw8bit test and the planner's low-bit row run it compiled, as users do; the tests
# whose subject is something else (a checkpoint, a wrapper, the third-party matrix) run it eagerly on both sides of
# each comparison: the same code, uncompiled.
def eager_compile() -> contextlib.AbstractContextManager[None]:
    """``torch.compile``-d functions run eagerly inside it (``torch.compiler.set_stance("force_eager")``)."""
    return torch.compiler.set_stance("force_eager")


def eagerly(scenario: Callable) -> Callable:
    """A rank's scenario (``ranks.run``) run under :func:`eager_compile` in its rank's process."""
    @functools.wraps(scenario)
    def run(*args, **kwargs):
        with eager_compile():
            return scenario(*args, **kwargs)

    return run

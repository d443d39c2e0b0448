"""The shape of ``dist_optim.json``, checked as a whole before a load touches anything.

A damaged or hand-edited file would otherwise surface as a raw ``TypeError``/``KeyError`` half-way through a
load (after the weights were already copied), or not at all (a negative ``lr`` trains on). Every problem found is
listed in one :class:`CheckpointError`, named by its key path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._storage import CheckpointError

__all__: list[str] = []

# Hyperparameters whose valid range is known for every torch optimizer that has them.
_NON_NEGATIVE = ("lr", "weight_decay", "eps", "momentum", "dampening", "lr_decay", "initial_lr", "alpha")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        v = v.item()  # a hyperparameter some classes keep as a tensor (torchao's lr), as the codec writes it
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def need(self, ok: bool, path: str, rule: str, value: Any) -> bool:
        if not ok:
            self.problems.append(f"{path} must be {rule}, got {value!r:.80}")
        return ok

    def field(self, node: dict[str, Any], key: str, path: str, rule: str, test: Callable[[Any], bool],
              optional: bool = False) -> bool:
        if key not in node:
            if not optional:
                self.problems.append(f"{path} is missing")
            return False
        return self.need(test(node[key]), path, rule, node[key])


def _str_keyed(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _check_optimizer(c: _Checker, opt: Any) -> None:
    if not c.need(isinstance(opt, dict), "optimizer", "a dict or null", opt):
        return
    c.field(opt, "class", "optimizer.class", "a str", lambda v: isinstance(v, str))
    c.field(opt, "in_backward", "optimizer.in_backward", "a dict or null", lambda v: v is None or _str_keyed(v),
            optional=True)
    c.field(opt, "values", "optimizer.values", "a dict of {parameter name: dict}",
            lambda v: _str_keyed(v) and all(_str_keyed(x) for x in v.values()))
    if c.field(opt, "subclass_states", "optimizer.subclass_states", "a dict of {parameter name: {state key: dict}}",
               lambda v: _str_keyed(v) and all(_str_keyed(x) and all(_str_keyed(d) for d in x.values())
                                               for x in v.values()), optional=True):
        for name, keys in opt["subclass_states"].items():
            for key, d in keys.items():
                where = f"optimizer.subclass_states[{name!r}][{key!r}]"
                c.field(d, "class", f"{where}.class", "a str (a tensor subclass's qualified name)",
                        lambda v: isinstance(v, str))
                if c.field(d, "layout", f"{where}.layout", "'replicated' or 'sharded'",
                           lambda v: v in ("replicated", "sharded")) and d["layout"] == "sharded":
                    c.field(d, "world_size", f"{where}.world_size", "an int >= 1", lambda v: _is_int(v) and v >= 1)
                    c.field(d, "ranks", f"{where}.ranks",
                            "a list with a dict per saved rank (null: a plain shard, in older checkpoints)",
                            lambda v: isinstance(v, list) and len(v) == d.get("world_size")
                            and all(r is None or _str_keyed(r) for r in v))
                elif d.get("layout") == "replicated":
                    c.field(d, "inner", f"{where}.inner", "a dict", _str_keyed)
    if not c.field(opt, "param_groups", "optimizer.param_groups", "a list of dicts",
                   lambda v: isinstance(v, list) and all(_str_keyed(g) for g in v)):
        return
    seen: set[str] = set()
    for gi, g in enumerate(opt["param_groups"]):
        where = f"optimizer.param_groups[{gi}]"
        if c.field(g, "params", f"{where}.params", "a list", lambda v: isinstance(v, list)):
            for k, name in enumerate(g["params"]):
                if c.need(isinstance(name, str), f"{where}.params[{k}]", "a str (a parameter name)", name):
                    c.need(name not in seen, f"{where}.params[{k}]", "a name listed once", name)
                    seen.add(name)
        if "optimizer_class" in g:
            c.need(isinstance(g["optimizer_class"], str), f"{where}.optimizer_class", "a str (a class's qualified name)",
                   g["optimizer_class"])
        for key in _NON_NEGATIVE:
            if key in g:
                c.need(_is_number(g[key]) and g[key] >= 0, f"{where}.{key}", "a number >= 0", g[key])
        if "betas" in g:
            c.need(isinstance(g["betas"], (tuple, list)) and len(g["betas"]) == 2
                   and all(_is_number(b) and 0 <= b < 1 for b in g["betas"]), f"{where}.betas",
                   "two numbers in [0, 1)", g["betas"])


def _python_rng(v: Any) -> bool:
    return (isinstance(v, tuple) and len(v) == 3 and _is_int(v[0]) and isinstance(v[1], tuple)
            and all(_is_int(x) for x in v[1]) and (v[2] is None or isinstance(v[2], float)))


def validate(plain: Any, where: str) -> None:
    """Raise one :class:`CheckpointError` listing every way ``plain`` differs from what :func:`save` writes."""
    c = _Checker()
    if not c.need(_str_keyed(plain), "dist_optim.json", "a JSON object", type(plain).__name__):
        raise CheckpointError(f"{where}: " + c.problems[0])
    c.field(plain, "step", "step", "an int >= 0 or null", lambda v: v is None or _is_int(v) and v >= 0)
    c.field(plain, "world_size", "world_size", "an int >= 1", lambda v: _is_int(v) and v >= 1)
    c.field(plain, "extra", "extra", "a dict", _str_keyed)
    c.field(plain, "model", "model", "a list of parameter names",
            lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v))
    if plain.get("optimizer") is not None:
        _check_optimizer(c, plain["optimizer"])
    if c.field(plain, "schedulers", "schedulers", "a list", lambda v: isinstance(v, list), optional=True):
        for i, s in enumerate(plain["schedulers"]):
            c.need(_str_keyed(s), f"schedulers[{i}]", "a dict (a scheduler's state_dict)", s)
    c.field(plain, "grad_scaler", "grad_scaler", "a dict or null", lambda v: v is None or _str_keyed(v),
            optional=True)
    if c.field(plain, "rng", "rng", "a list", lambda v: isinstance(v, list), optional=True):
        for i, state in enumerate(plain["rng"]):
            if c.need(_str_keyed(state), f"rng[{i}]", "a dict", state):
                c.field(state, "python", f"rng[{i}].python", "the tuple of random.getstate()", _python_rng)
                c.field(state, "numpy", f"rng[{i}].numpy", "the 5-tuple of numpy.random.get_state()",
                        lambda v: isinstance(v, tuple) and len(v) == 5, optional=True)
    if c.problems:
        raise CheckpointError(
            f"{where}: dist_optim.json is damaged ({len(c.problems)} problem(s)); nothing was loaded:\n  "
            + "\n  ".join(c.problems)
        )

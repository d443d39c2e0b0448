"""What the planner says when a model's step cannot run on fake tensors: one line naming the operator, the module
that called it and the way out (:class:`UnplannableOperator`), in place of torch's traceback from inside
``FakeTensorMode``.

:func:`named_operators` watches every operator of the region and the module whose forward is running; an operator
that raises is recorded and the exception left as it is (torch's own code may catch it), and only if it ends the
region is it said again as :class:`UnplannableOperator`. :class:`FakeCopies` lets a builder ``copy.deepcopy`` fake
modules (every ``nn.TransformerEncoder`` does), which torch's own deepcopy of a fake tensor cannot ("Mixing fake modes
NYI").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode

from dist_optim._torch_internals import TorchDispatchMode, tree_leaves
from dist_optim.engine._inputs import dtensor_class

__all__: list[str] = []

# the way out, by what the operator's failure says (first match); the last is the default
WAYS_OUT = (
    (("data-dependent", "DataDependent", "DynamicOutputShape", "nonzero", ".item()"),
     "its output's shape depends on the tensors' values (an MoE's routing, a boolean mask), which fake tensors do "
     "not have: plan a variant of the module whose shapes do not depend on values (for transformers' MoE models: "
     "the default grouped experts with bfloat16 parameters, --dtype bfloat16), or measure one real step"),
    (("BF16", "bfloat16", "Float16", "dtype"),
     "the operator takes other dtypes than the model's: plan with the dtype the kernel takes (for transformers' "
     "grouped experts: --dtype bfloat16), or measure one real step"),
    ((), "the operator has no fake-tensor (meta) implementation: plan a model that avoids it, or measure one real "
         "step"),
)


class FakeCopies(TorchFunctionMode):
    """``copy.deepcopy`` of a tensor made under the planner's ``FakeTensorMode`` (entered before): a clone in that
    mode, a new storage as a real deepcopy makes, a parameter again if it was one."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.Tensor.__deepcopy__:
            return func(*args, **(kwargs or {}))
        t, memo = args
        if id(t) not in memo:
            with torch.no_grad():
                out = t.clone()
            memo[id(t)] = (nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else
                           out.requires_grad_(t.requires_grad))
        return memo[id(t)]


class UnplannableOperator(NotImplementedError):
    """An operator of the model's step cannot run on fake tensors; the message is one line and says the way out."""


class _Watch(TorchDispatchMode):
    """Every operator: the one that raised, with the module running then (``failed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[nn.Module] = []  # the forwards running now, innermost last
        self.failed: tuple[Any, nn.Module | None, BaseException] | None = None  # (operator, module, exception)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, dtensor_class()) for t in types):  # DTensor runs its local operators with this mode on
            return NotImplemented
        try:
            return func(*args, **(kwargs or {}))
        except Exception as e:
            self.failed = (func, self.modules[-1] if self.modules else None, e)
            raise


def _name(module: nn.Module | None, model: nn.Module | None) -> str:
    """The module's name in the model and its class (no module: the operator ran outside a forward)."""
    if module is None:
        return "no module's forward (backward or the optimizer step)"
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    name = names.get(id(module))
    if name is None:
        return type(module).__name__
    return f"{name or 'the model'} ({type(module).__name__})"


def _says(e: BaseException) -> str:
    text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return text if len(text) <= 240 else text[:237] + "..."


@contextlib.contextmanager
def named_operators(model: list[nn.Module]) -> Iterator[None]:
    """Run the region (under ``FakeTensorMode``, entered before); an operator failing it is raised again as
    :class:`UnplannableOperator` (``model``: a list the caller fills with the model once built, for the message)."""
    watch = _Watch()

    def enter(module: nn.Module, args: Any) -> None:
        watch.modules.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if watch.modules and watch.modules[-1] is module:
            watch.modules.pop()
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    # torch logs a failing meta kernel with its traceback before raising: the one line below says it instead
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addFilter(_no_meta_traceback)
    try:
        with watch:
            yield
    except Exception as e:
        failed = watch.failed
        if failed is None or not _caused_by(e, failed[2]):
            raise
        func, where, cause = failed
        said = _says(cause)
        way = next(w for keys, w in WAYS_OUT if not keys or any(k in said for k in keys))
        raise UnplannableOperator(
            f"{func} cannot run on fake tensors, called from {_name(where, model[0] if model else None)}: {said}; "
            f"the way out: {way}") from None
    finally:
        fake_log.removeFilter(_no_meta_traceback)
        for h in handles:
            h.remove()


def _no_meta_traceback(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("failed while attempting to run meta")


def _caused_by(e: BaseException, cause: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if e is cause:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def check_positions(model: nn.Module, batch: Any) -> None:
    """Refuse a batch whose sequences are longer than the model's learned positions: a job that cannot run (the
    real forward indexes past its position embedding), which fake tensors would plan without a word. The positions
    are the model's ``block_size`` or ``config.max_position_embeddings`` where an ``nn.Embedding`` of that many rows
    holds them (rotary or relative positions have no such limit)."""
    config = getattr(model, "config", None)
    positions = getattr(model, "block_size", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or not any(isinstance(m, nn.Embedding) and m.num_embeddings == positions
                                                 for m in model.modules()):
        return
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 2 and t.shape[1] > positions:
            raise ValueError(f"the batch's sequences are {t.shape[1]} tokens, above the model's {positions} learned "
                             f"positions (its block_size or max_position_embeddings): the job cannot run; make them "
                             f"{positions} tokens or fewer")

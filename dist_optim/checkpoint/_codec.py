"""Plain (non-tensor) checkpoint data as JSON: reading it back can never execute code.

JSON lacks tuples, non-string keys and tensors; those are written as tagged objects and restored exactly, so a
scheduler's or an optimizer's hyperparameters come back with the types they were saved with.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

__all__: list[str] = []


def encode(value: Any, path: str = "") -> Any:
    """A JSON-able form of ``value``; ``TypeError`` naming the key path for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") and k.endswith("__") for k in value):
            return {k: encode(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        return {"__items__": [[encode(k, path), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and not value.is_sparse and value.numel() <= 64:
        t = value.detach().cpu()
        return {"__tensor__": t.tolist(), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise TypeError(
        f"cannot store {type(value).__name__} at {path or 'top level'!r} in a checkpoint: plain data is written as "
        "JSON (numbers, strings, lists, dicts, tuples, small tensors) so that loading never runs code; convert it"
    )


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=_dtype(value["dtype"])).reshape(value["shape"])
    if "__dtype__" in value:
        return _dtype(value["__dtype__"])
    return {k: decode(v) for k, v in value.items()}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint names {name!r} as a dtype; it is not one")
    return dtype


def dumps(value: Any) -> str:
    return json.dumps(encode(value), allow_nan=False, indent=1)


def loads(text: str) -> Any:
    return decode(json.loads(text))

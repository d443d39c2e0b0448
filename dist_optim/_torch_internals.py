"""Every private torch name dist_optim uses, in one place (the lead's entries; merged with the full module)."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as _optimizer

graph_task_id = torch._C._current_graph_task_id


def global_step_pre_hooks() -> dict[int, Any]:
    return _optimizer._global_optimizer_pre_hooks


def global_step_post_hooks() -> dict[int, Any]:
    return _optimizer._global_optimizer_post_hooks


def step_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_step_pre_hooks


def step_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_step_post_hooks


def fires_own_step_hooks(step: Any) -> Any:
    step.hooked = True
    return step


def state_dict_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_state_dict_pre_hooks


def state_dict_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_state_dict_post_hooks


def load_state_dict_pre_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_load_state_dict_pre_hooks


def load_state_dict_post_hooks(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return opt._optimizer_load_state_dict_post_hooks


def scaler_factors(scaler: torch.amp.GradScaler) -> dict[str, float]:
    return {"init_scale": scaler._init_scale, "growth_factor": scaler._growth_factor,
            "backoff_factor": scaler._backoff_factor}

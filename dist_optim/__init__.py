"""dist_optim: the optimizer step inside the backward pass, exactly like the standard loop, with less memory."""

from dist_optim._factory import in_backward
from dist_optim._planner._fit import fit_settings
from dist_optim._planner._fit_model import fit
from dist_optim._planner._fit_types import FitCandidate, FitResult, FitSetting
from dist_optim._planner._pipeline import PipelinePlan
from dist_optim._planner._plan import LoopPlan, MemoryPlan, plan
from dist_optim.averaging import average_in_backward
from dist_optim.engine._grad_policy import StepStats
from dist_optim.engine._options import InBackwardOptions
from dist_optim.optimizer import InBackwardOptimizer
from dist_optim.parallel._seed_pair import (
    apply_optimizer_in_backward,
    get_in_backward_optimizers,
)
from dist_optim.pipeline import pipeline_optimizers

__all__ = [
    "FitCandidate",
    "FitResult",
    "FitSetting",
    "InBackwardOptimizer",
    "InBackwardOptions",
    "LoopPlan",
    "MemoryPlan",
    "PipelinePlan",
    "StepStats",
    "apply_optimizer_in_backward",
    "average_in_backward",
    "fit",
    "fit_settings",
    "get_in_backward_optimizers",
    "in_backward",
    "pipeline_optimizers",
    "plan",
]

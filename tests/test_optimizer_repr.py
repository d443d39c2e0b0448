"""``repr(opt)`` names the wrapped class, the engine options set, and per group the class and the kernel that runs:
the engine's choice (``fused`` where the group left ``fused``/``foreach`` unset) or the group's own flags, checked
against the inner optimizer actually built for a bucket."""

from __future__ import annotations

import re

import torch

import dist_optim


def test_repr_names_the_class_the_kernel_that_runs_and_the_options():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = dist_optim.InBackwardOptimizer(
        [{"params": model[0].parameters()},
         {"params": model[1].parameters(), "optimizer_class": torch.optim.SGD, "foreach": False}],
        torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0, clip_mode="two_pass", bucket_cap_mb=1e-5,
    )
    text = repr(opt)
    assert text.startswith("InBackwardOptimizer(AdamW, SGD; options: bucket_cap_mb=1e-05, max_grad_norm=1.0, "
                           "clip_mode='two_pass') (\nParameter Group 0\n    in backward: AdamW, kernel fused\n")
    assert re.search(r"Parameter Group 1\n    in backward: SGD, kernel for-loop\n", text)
    assert "    fused: None" in text  # the group's own setting, as the user gave it
    # the kernel named is the one the engine builds the bucket's optimizer with
    inner = opt._recipe.build([(0, False, list(model[0].parameters()))])[0]
    assert inner.optimizer.param_groups[0]["fused"] is True


def test_repr_of_defaults_and_a_class_with_its_own_step():
    opt = dist_optim.InBackwardOptimizer(torch.nn.Linear(3, 3), torch.optim.Adamax, lr=1e-3)
    assert repr(opt).startswith("InBackwardOptimizer(Adamax; options: defaults) (\nParameter Group 0\n"
                                "    in backward: Adamax, kernel foreach\n")

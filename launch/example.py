"""A small in-backward training run that prints what it did (the main job until the torchrun trainer lands).

Run:
    python launch/example.py
It trains a tiny MLP twice from the same seed, once with the standard loop and once with
``dist_optim.InBackwardOptimizer``, and prints the losses of both and whether the parameters are bitwise equal.
"""

from __future__ import annotations

import copy
import logging

import torch

import dist_optim

log = logging.getLogger("example")


def main(steps: int = 20) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)
    data = [(torch.randn(16, 32), torch.randn(16, 1)) for _ in range(steps)]

    opt = dist_optim.InBackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=steps)

    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # AdamW steps inside this call; gradients are freed as they are consumed
        sched.step()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        log.info("step %2d  lr %.5f  loss in-backward %.6f  standard %.6f", step, opt.param_groups[0]["lr"],
                 loss.item(), ref_loss.item())
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    log.info("parameters bitwise equal to the standard loop after %d steps: %s", steps, same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

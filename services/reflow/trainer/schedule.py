"""The learning rate of each training step (trainer.lr_schedule, warmup_steps,
min_lr_ratio), and setting it on the optimizer before the step.

The rate is a function of the step number alone, never a scheduler object's
state: a trainer resumed from a checkpoint (trainer/checkpoint.py), whose
optimizer state carries whatever rate was last set, and a replica that joins
the group by a role flip (trainer/replica.py) each set the rate of the step they
are about to take, so the schedule goes on where it stood with nothing to save
or hand over.

The laws are Hugging Face's (transformers.optimization): step k, counted from 0
(the number of optimizer steps before it), trains at learning_rate x
- k / W during a warm-up of W steps (so the first warm-up step trains at 0, as
  `get_linear_schedule_with_warmup` has it), then
- constant: 1;
- linear: m + (1 - m) (N - k) / (N - W);
- cosine: m + (1 - m) (1 + cos(pi (k - W) / (N - W))) / 2,
with N = trainer.num_steps and m = min_lr_ratio (`get_cosine_with_min_lr_schedule_with_warmup`'s
`min_lr_rate`; with m = 0 these are `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup`). So a TRL run mapped from the same spec
(bench/trl_grpo.py) trains at the same rates.
"""

from __future__ import annotations

import math

import torch

from reflow.core.trainer_config import TrainerConfig


def learning_rate_at(trainer: TrainerConfig, step: int) -> float:
    """The learning rate of training step `step` (1-based, as step records count)."""
    if step < 1:
        raise ValueError(f"step: {step}; training steps count from 1")
    k = step - 1
    warmup, total = trainer.warmup_steps, trainer.num_steps
    if k < warmup:
        return trainer.learning_rate * k / warmup
    if trainer.lr_schedule == "constant":
        return trainer.learning_rate
    # A run resumed past num_steps (a longer run from an old checkpoint) stays at the floor.
    progress = min(1.0, (k - warmup) / max(1, total - warmup))
    if trainer.lr_schedule == "linear":
        decayed = 1.0 - progress
    else:
        decayed = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = trainer.min_lr_ratio
    return trainer.learning_rate * (floor + (1.0 - floor) * decayed)


def set_learning_rate(optimizer: torch.optim.Optimizer, trainer: TrainerConfig,
                      step: int) -> float:
    """Set every parameter group's rate to step `step`'s; returns it."""
    lr = learning_rate_at(trainer, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr

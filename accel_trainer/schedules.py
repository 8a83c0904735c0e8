"""Learning-rate schedules: linear warmup, then cosine, linear or constant, stepped once per optimizer step.

The schedule is a plain `LambdaLR` on the unwrapped optimizer and is *not* passed to `accelerator.prepare`:
a prepared scheduler is stepped once per process per step (accelerate #2926, #1398), which would end the
schedule early on N processes. Stepping it once per optimizer step keeps the LR at step k identical on any
number of processes.
"""

from __future__ import annotations

import math

import torch

from .config import TrainConfig
from .errors import ConfigError


def peak_lr(cfg: TrainConfig) -> float:
    """The learning rate after the optional batch-size scaling rule.

    `linear` multiplies lr by global_batch_size / reference_batch_size (Goyal et al. 2017); `sqrt` by its
    square root (the rule often used with Adam, Malladi et al. 2022).
    """
    if cfg.lr_scaling == "none":
        return cfg.lr
    if cfg.reference_batch_size <= 0:
        raise ConfigError(f"lr_scaling={cfg.lr_scaling} needs reference_batch_size=<batch size lr was tuned at>")
    ratio = cfg.global_batch_size / cfg.reference_batch_size
    return cfg.lr * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Fraction of the peak LR used for optimizer step `step` (0-based: the first step is step 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Set every group's LR to the (scaled) peak and return the per-step schedule on top of it."""
    for group in optimizer.param_groups:
        group["lr"] = peak_lr(cfg)
        group["initial_lr"] = group["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))

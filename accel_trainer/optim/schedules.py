"""Learning-rate schedules: linear warmup, then cosine, linear or constant, stepped once per optimizer step; or one
of transformers' schedules by its name (warmup-stable-decay, cosine with a floor, ...), stepped the same way.

Each parameter group's own learning rate is its peak: the default optimizer gives every group `lr`, and a
recipe's `build_optimizer` may give each group its own (a small LR for a pretrained body, a large one for a
new head); the batch-size scaling rule and the schedule multiply each group's peak. A recipe may instead
return any torch LR scheduler from `build_scheduler(cfg, optimizer)`; the loop steps it the same way and
checkpoints it.

The schedule is a plain `LambdaLR` on the unwrapped optimizer and is *not* passed to `accelerator.prepare`:
a prepared scheduler is stepped once per process per step (accelerate #2926, #1398), which would end the
schedule early on N processes. Stepping it once per optimizer step keeps the LR at step k identical on any
number of processes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from accel_trainer.config.train_config import TrainConfig, wsd_decay_steps
from accel_trainer.errors import ConfigError, RecipeError

# Fields that shape the built-in schedule, and so do nothing when a recipe builds its own scheduler.
_SCHEDULE_FIELDS = ("lr_schedule", "warmup_steps", "min_lr_ratio", "decay_steps", "lr_scaling", "reference_batch_size")
OWN_SCHEDULES = ("cosine", "linear", "constant")
"""The schedules written here (min_lr_ratio's floor on cosine and linear); the others are transformers'."""


def lr_scale(cfg: TrainConfig) -> float:
    """The factor of the optional batch-size scaling rule, applied to every group's learning rate.

    `linear` is global_batch_size / reference_batch_size (Goyal et al. 2017); `sqrt` its square root (the
    rule often used with Adam, Malladi et al. 2022).
    """
    if cfg.lr_scaling == "none":
        return 1.0
    if cfg.reference_batch_size <= 0:
        raise ConfigError(f"lr_scaling={cfg.lr_scaling} needs reference_batch_size=<batch size lr was tuned at>")
    ratio = cfg.global_batch_size / cfg.reference_batch_size
    return ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio)


def peak_lr(cfg: TrainConfig) -> float:
    """The peak learning rate of the default optimizer: `lr` after the batch-size scaling rule."""
    return cfg.lr * lr_scale(cfg)


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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Scale each group's own LR (its peak) by the batch-size rule; return the per-step schedule on top."""
    scale = lr_scale(cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
        group["initial_lr"] = group["lr"]
    if cfg.lr_schedule not in OWN_SCHEDULES:
        return library_scheduler(optimizer, cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


def library_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' schedule named `lr_schedule` (`get_scheduler`, as the HF Trainer builds it), with warmup_steps,
    max_steps, and where the schedule has one, min_lr_ratio's floor (and WSD's decay_steps).

    Raises:
        ConfigError: transformers is not installed.
    """
    try:
        from transformers import get_scheduler
    except ImportError:
        raise ConfigError(
            f"lr_schedule={cfg.lr_schedule} is transformers' schedule: pip install transformers (or use cosine,"
            " linear or constant)"
        ) from None
    floor = {"warmup_stable_decay": "min_lr_ratio", "cosine_with_min_lr": "min_lr_rate"}
    floor["cosine_warmup_with_min_lr"] = "min_lr_rate"
    kwargs: dict[str, Any] = {floor[cfg.lr_schedule]: cfg.min_lr_ratio} if cfg.lr_schedule in floor else {}
    if cfg.lr_schedule == "warmup_stable_decay":
        kwargs["num_decay_steps"] = wsd_decay_steps(cfg)
    return get_scheduler(  # type: ignore[no-any-return]
        cfg.lr_schedule, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps,
        scheduler_specific_kwargs=kwargs,
    )  # fmt: skip


def recipe_scheduler(recipe: Any, cfg: TrainConfig, optimizer: torch.optim.Optimizer, *, warn: bool) -> Any:
    """The run's scheduler: the recipe's `build_scheduler` if it returns one, else the built-in schedule.

    Warns (when `warn`, on the main process) about settings the user changed that cannot take effect: `lr`
    when the recipe's own optimizer uses none of it, schedule fields when the recipe brings its scheduler.

    Raises:
        RecipeError: `build_scheduler` returned something that is not an LR scheduler of `optimizer`, or
            returned None while `build_optimizer` had attached a scheduler (torch marks the param groups with
            `initial_lr`), which the built-in schedule would silently override.
    """
    defaults = type(cfg)()
    changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    attached = any("initial_lr" in group for group in optimizer.param_groups)  # torch schedulers mark the groups
    custom = recipe.build_scheduler(cfg, optimizer)
    _check_attached(attached, custom, optimizer)
    if custom is None:
        group_lrs = [group["lr"] for group in optimizer.param_groups]
        decays = [group.get("weight_decay") for group in optimizer.param_groups]
        if warn and "weight_decay" in changed and cfg.weight_decay not in decays:
            warnings.warn(
                f"accel-trainer: weight_decay={cfg.weight_decay} has no effect: the recipe's build_optimizer sets its"
                f" own ({', '.join(str(decay) for decay in decays)})",
                stacklevel=2,
            )
        if warn and "lr" in changed and cfg.lr not in group_lrs:
            warnings.warn(
                f"accel-trainer: lr={cfg.lr} has no effect: the recipe's build_optimizer sets its own learning rates"
                f" ({', '.join(f'{lr:g}' for lr in group_lrs)}), which the schedule multiplies",
                stacklevel=2,
            )
        return build_scheduler(optimizer, cfg)
    if not isinstance(custom, torch.optim.lr_scheduler.LRScheduler):
        raise RecipeError(
            f"build_scheduler returned {type(custom).__name__}, not a torch.optim.lr_scheduler.LRScheduler"
            " (return None to use the built-in schedule)"
        )
    ignored = [name for name in _SCHEDULE_FIELDS if name in changed]
    if warn and ignored:
        warnings.warn(
            f"accel-trainer: {', '.join(ignored)} have no effect: the recipe's build_scheduler builds the schedule",
            stacklevel=2,
        )
    return custom


def _check_attached(attached: bool, custom: Any, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler built in build_optimizer must be the one build_scheduler returns, and that one must step the
    optimizer it was given (see recipe_scheduler)."""
    if custom is None and attached:
        raise RecipeError(
            "build_optimizer attached an LR scheduler to its optimizer, which the built-in schedule would override:"
            " return that scheduler from build_scheduler(cfg, optimizer) (keep it on self), and the loop steps it"
        )
    if isinstance(custom, torch.optim.lr_scheduler.LRScheduler) and custom.optimizer is not optimizer:
        raise RecipeError(
            "build_scheduler returned a scheduler of another optimizer than the one it was given: build it on"
            " build_scheduler's `optimizer` argument"
        )

"""Values of a TrainConfig that are valid but probably not what was meant: said once, on the main process, before
any work (training.py)."""

from __future__ import annotations

from accel_trainer.config.train_config import TrainConfig


def config_warnings(config: TrainConfig) -> list[str]:
    """Values that are valid but probably not what was meant."""
    problems = []
    if config.warmup_steps > config.max_steps:
        problems.append(
            f"warmup_steps={config.warmup_steps} is beyond max_steps={config.max_steps}: the learning rate never"
            " reaches its peak"
        )
    floors = ("cosine", "linear", "warmup_stable_decay", "cosine_with_min_lr", "cosine_warmup_with_min_lr")
    ignored = {
        "min_lr_ratio": config.min_lr_ratio and config.lr_schedule not in floors,
        "decay_steps": config.decay_steps and config.lr_schedule != "warmup_stable_decay",
        "momentum": config.momentum != TrainConfig.momentum and config.optimizer != "sgd",
    }
    problems += [f"{name} has no effect with lr_schedule={config.lr_schedule} optimizer={config.optimizer}"
                 for name, moot in ignored.items() if moot]  # fmt: skip
    if not config.skip_nonfinite_steps and config.max_nonfinite_in_a_row != TrainConfig.max_nonfinite_in_a_row:
        problems.append(
            f"max_nonfinite_in_a_row={config.max_nonfinite_in_a_row} has no effect with skip_nonfinite_steps=false:"
            " nothing checks the loss for NaN or Inf"
        )
    return problems

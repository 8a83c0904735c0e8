"""The BatchNorm classifier with NaN poured into chosen steps: into the inputs (every statistic and gradient goes
NaN) or only into the reported loss (a detached term: the gradients stay finite), on every process or one."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

import accel_trainer as at

BatchNormClassifier = at.get_recipe("batchnorm")  # discovered from this folder before this module (sorted names)


@dataclass
class PoisonedConfig(BatchNormClassifier.Config):
    global_batch_size: int = 8  # one micro-batch per step and process: a call of compute_loss is a step
    max_steps: int = 10
    eval_every_steps: int = 0
    log_every_steps: int = 1
    lr_schedule: Literal["cosine", "linear", "constant"] = "linear"  # each step's LR shows if the schedule moved
    poison_steps: str = ""
    """Comma-separated steps whose micro-batch is poisoned."""
    poison: str = "input"
    """input: NaN inputs; loss: a NaN added to the loss through a detached term."""
    poison_rank: int = -1
    """The only process that is poisoned; -1: all of them."""
    optimizer_skips_on_device: bool = True
    """False: the (fused) AdamW says it cannot skip a step on the device, so the non-finite guard reads every
    verdict before the step (stopping/nonfinite.py): the same kernel on the guard's immediate path."""


@at.register_recipe("poisoned")
class Poisoned(BatchNormClassifier):
    """BatchNorm classifier whose chosen steps are NaN."""

    Config = PoisonedConfig

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = 0

    def build_optimizer(self, cfg, model):
        """AdamW, which writes `late_steps_rank<r>.txt` into the run folder: how many of its steps were handed a
        device verdict (`found_inf`) so far, i.e. taken before the guard read theirs."""
        optimizer = super().build_optimizer(cfg, model)
        if not cfg.optimizer_skips_on_device:
            optimizer._step_supports_amp_scaling = False  # what optim/device_skip.py asks
        late = Path(cfg.output_dir) / f"late_steps_rank{_rank()}.txt"
        late.unlink(missing_ok=True)

        def count(optimizer, *_):
            if hasattr(optimizer, "found_inf"):
                late.write_text(str(int(late.read_text() if late.exists() else 0) + 1))

        optimizer.register_step_pre_hook(count)
        return optimizer

    def compute_loss(self, model, batch):
        if batch["x"].is_meta:  # FLOP counting, not a step
            return super().compute_loss(model, batch)
        self.calls += 1
        cfg = self.cfg
        poisoned = str(self.calls) in cfg.poison_steps.split(",") and cfg.poison_rank in (-1, _rank())
        x = batch["x"] * float("nan") if poisoned and cfg.poison == "input" else batch["x"]
        loss = super().compute_loss(model, {**batch, "x": x})
        if poisoned and cfg.poison == "loss":
            loss = loss + float("nan") * loss.detach()
        return loss


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

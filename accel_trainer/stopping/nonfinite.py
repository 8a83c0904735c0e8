"""Skipping the optimizer steps whose loss or gradient norm is NaN or Inf, and stopping a run that keeps making them.

One bad batch (a corrupt sample, a log of zero, an overflow) would otherwise write NaN into every weight and the
run would train on, logging `nan`, until max_steps. With `skip_nonfinite_steps` (the default) every step's loss
(this process's micro-batches) and gradient norm (over all processes) are checked, and all processes agree on
the verdict with one all-reduce of one number. A non-finite step then changes nothing: no optimizer step, no
schedule step, no EMA update, its gradients dropped, the BatchNorm statistics its forward passes moved put back,
and its loss left out of the logged mean; it is counted (`nonfinite_steps`, logged and checkpointed). After
`max_nonfinite_in_a_row` such steps in a row the run saves a checkpoint, which holds the weights of the last good
step (skipped steps changed nothing), and stops with a one-line error.

The price is one host read per step, where the loop otherwise reads back only at log steps (Megatron-LM pays
the same for its NaN check); `skip_nonfinite_steps=false` removes it. Under fp16 the gradient scaler already
skips steps with inf/NaN gradients (`skipped_steps`), which are its normal business, so there only the loss is
checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch.nn.modules.batchnorm import _NormBase

from accel_trainer.checkpoint.train_state import SavedFields
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.losses import LossOutput
from accel_trainer.errors import UserError


class NonfiniteSteps(UserError):
    """The loss or gradient norm stayed non-finite for max_nonfinite_in_a_row steps."""


@dataclass
class NonfiniteCounts(SavedFields):
    """The guard's counts, saved in each checkpoint and logged."""

    nonfinite_steps: int = 0
    """Steps skipped because their loss or gradient norm was NaN or Inf."""
    nonfinite_in_a_row: int = 0
    """The latest of those in a row, up to this step (0: this step was finite)."""


class NonfiniteGuard:
    """Decides, alike on every process, whether a step's loss and gradients are finite enough to take it (made
    only with skip_nonfinite_steps); owns its counts, which the checkpointer saves and restores (`state_dict`)."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator, model: torch.nn.Module) -> None:
        self.max_in_a_row = cfg.max_nonfinite_in_a_row
        self.accelerator = accelerator
        self.counts = NonfiniteCounts()
        self.checks_gradients = accelerator.scaler is None  # fp16: inf gradients are the scaler's to skip
        # Running statistics move in every training forward pass, taken step or not: kept to put them back.
        self.statistics = [
            buffer
            for module in model.modules()
            if isinstance(module, _NormBase) and module.track_running_stats
            for buffer in module.buffers(recurse=False)
        ]
        self.good_statistics = [buffer.clone() for buffer in self.statistics]

    def step_is_finite(self, outputs: list[LossOutput], grad_norm: torch.Tensor | None, count: bool = True) -> bool:
        """Whether to take this step: its losses and gradient norm are finite on every process. Counts a step that
        is not (nonfinite_steps, and nonfinite_in_a_row, which a resume continues); with `count` false (one phase
        of an alternating step) the caller counts the whole step afterwards (`count`)."""
        # One sum is finite exactly when all its terms are (NaN and Inf propagate): a few small ops a step.
        total = outputs[0].loss.detach().float()
        for output in outputs[1:]:
            total = total + output.loss.detach().float()
        if self.checks_gradients and grad_norm is not None:
            total = total + grad_norm.detach().to(total.device)
        if self.accelerator.num_processes > 1:  # the loss is this process's: the sum over processes tells all
            total = self.accelerator.reduce(total, reduction="sum")
        finite = math.isfinite(total.item())  # the step's one read-back; faster than torch.isfinite on a scalar
        if self.statistics:  # keep a finite step's statistics; put back those a non-finite one moved
            kept, moved = self.good_statistics, self.statistics
            torch._foreach_copy_(*((kept, moved) if finite else (moved, kept)))
        if count:
            self.count(finite)
        return finite

    def count(self, finite: bool) -> None:
        """Count a step, finite or not."""
        if finite:
            self.counts.nonfinite_in_a_row = 0
        else:
            self.counts.nonfinite_steps += 1
            self.counts.nonfinite_in_a_row += 1

    def state_dict(self) -> dict[str, Any]:
        return self.counts.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """The saved counts. A resumed run continues a streak cut short by a preemption; one that the guard itself
        stopped starts a new allowance (rerunning it is the user's decision to go on)."""
        self.counts.load_state_dict(saved)
        if self.gives_up():
            self.counts.nonfinite_in_a_row = 0

    def gives_up(self) -> bool:
        """max_nonfinite_in_a_row steps in a row were not finite: the run saves and stops."""
        return self.counts.nonfinite_in_a_row >= self.max_in_a_row

    def error(self, step: int, checkpoint: Any) -> NonfiniteSteps:
        """The one line the run stops with after `step`."""
        count = self.counts.nonfinite_in_a_row
        first = step - count + 1
        steps = f"step {step}" if count == 1 else f"steps {first}-{step}"
        return NonfiniteSteps(
            f"the loss or gradient norm was NaN or Inf in {steps} ({count} in a row; max_nonfinite_in_a_row="
            f"{self.max_in_a_row}); checkpoint {checkpoint} holds the weights of step {first - 1}, the last finite"
            " one. Check the data of those steps; rerun the same command to go on past them, or start a new run"
            " from that checkpoint with a lower lr or more warmup_steps: resume=<checkpoint> output_dir=<new folder>"
        )

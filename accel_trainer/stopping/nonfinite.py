"""Skipping the optimizer steps whose loss or gradient norm is NaN or Inf, and stopping a run that keeps making them.

One bad batch (a corrupt sample, a log of zero, an overflow) would otherwise write NaN into every weight and the
run would train on, logging `nan`, until max_steps. With `skip_nonfinite_steps` (the default) every step's loss
(this process's micro-batches) and gradient norm (over all processes) are checked, and all processes agree on
the verdict with one all-reduce of one number. A non-finite step then changes nothing: no optimizer step, no
schedule step, no EMA update, its gradients dropped, the BatchNorm statistics its forward passes moved put back,
and its loss left out of the logged mean; it is counted (`nonfinite_steps`, logged and checkpointed). After
`max_nonfinite_in_a_row` such steps in a row the run saves a checkpoint, which holds the weights of the last good
step (skipped steps changed nothing), and stops with a one-line error.

The verdict is read on the host a step late wherever the optimizers can skip a step on the device
(optim/device_skip.py: torch's fused Adam, AdamW, SGD, Adagrad, the default AdamW among them, on the CPU and CUDA,
one process or DDP): the step is taken with the verdict as their `found_inf`, the BatchNorm statistics and the EMA
follow it on the device, and what only the host does for a taken step (the schedule step, the loss into the
logged mean, the counts) waits in `pending` until the next step reads the verdict (`settle`), by then long
computed, so the device never waits for the host. A step is decided at once, as it was before, where something
reads its outcome right away or it cannot be undone: a log step, a step that could end the run (the
`max_nonfinite_in_a_row`-th in a row; so every step with max_nonfinite_in_a_row=1), an optimizer's first step
(its state is made then), and on layouts or optimizers without the skip (fp16's gradient scaler, FSDP, tensor
parallelism, pipelines, alternating optimizers, foreach or single-tensor optimizers); there the price is one
host read a step, as Megatron-LM pays for its NaN check. A checkpoint settles a pending step first (`state_dict`,
asked before the schedules are saved), so it holds what the immediate path saves. Under fp16 the gradient
scaler already skips steps with inf/NaN gradients (`skipped_steps`), which are its normal business, so there
only the loss is checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


class LateRead:
    """A device bool read on the host later: on CUDA copied into pinned memory behind the work queued so far, so the
    read waits for that work only, never for what was queued after it; elsewhere the tensor itself."""

    def __init__(self, value: torch.Tensor) -> None:
        self.copied: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            value = value.to("cpu", non_blocking=True)  # pinned: the copy does not stop the host
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.value = value

    def read(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return bool(self.value.item())


@dataclass(frozen=True)
class Pending:
    """A step taken before its verdict was read: the verdict, and what the host does if it says finite."""

    finite: LateRead
    on_finite: Callable[[], None]


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
        self.pending: Pending | None = None  # a step taken before its verdict was read (`wait_for`)

    def step_is_finite(self, outputs: list[LossOutput], grad_norm: torch.Tensor | None, count: bool = True) -> bool:
        """Whether to take this step, read now: its losses and gradient norm are finite on every process. Counts a
        step that is not (nonfinite_steps, and nonfinite_in_a_row, which a resume continues); with `count` false
        (one phase of an alternating step) the caller counts the whole step afterwards (`count`)."""
        finite = math.isfinite(self._total(outputs, grad_norm).item())  # faster than torch.isfinite on a scalar
        if self.statistics:  # keep a finite step's statistics; put back those a non-finite one moved
            kept, moved = self.good_statistics, self.statistics
            torch._foreach_copy_(*((kept, moved) if finite else (moved, kept)))
        if count:
            self.count(finite)
        return finite

    def verdict(self, outputs: list[LossOutput], grad_norm: torch.Tensor | None) -> torch.Tensor:
        """`step_is_finite`'s answer left on the device (a bool), for a step decided late (`wait_for`)."""
        return torch.isfinite(self._total(outputs, grad_norm))

    def may_wait(self) -> bool:
        """Whether this step's verdict may wait for the next step: the previous one's is read and this one cannot
        end the run (it would need to be the max_nonfinite_in_a_row-th non-finite step in a row)."""
        return self.pending is None and self.counts.nonfinite_in_a_row + 1 < self.max_in_a_row

    def wait_for(self, finite: torch.Tensor, on_finite: Callable[[], None]) -> None:
        """Leave `finite` (this step's `verdict`) to be read at the next step: the BatchNorm statistics follow it on
        the device now (before the EMA, which averages them, does); `on_finite` is what the host does for a taken
        step, done once the verdict is read."""
        if self.statistics:  # kept where finite, put back where not: the same values the immediate path copies
            pairs = zip(self.statistics, self.good_statistics, strict=True)
            kept = [torch.where(finite, moved, good) for moved, good in pairs]
            torch._foreach_copy_(self.good_statistics, kept)
            torch._foreach_copy_(self.statistics, kept)
        self.pending = Pending(LateRead(finite), on_finite)

    def settle(self) -> None:
        """Read the pending step's verdict, if any: count the step and, finite, do what it left for the host."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        finite = pending.finite.read()
        self.count(finite)
        if finite:
            pending.on_finite()

    def _total(self, outputs: list[LossOutput], grad_norm: torch.Tensor | None) -> torch.Tensor:
        """One number, finite exactly when every loss and the gradient norm are on every process (NaN and Inf
        propagate through a sum): a few small ops a step, and one all-reduce of one number."""
        total = outputs[0].loss.detach().float()
        for output in outputs[1:]:
            total = total + output.loss.detach().float()
        if self.checks_gradients and grad_norm is not None:
            total = total + grad_norm.detach().to(total.device)
        if self.accelerator.num_processes > 1:  # the loss is this process's: the sum over processes tells all
            total = self.accelerator.reduce(total, reduction="sum")
        return total

    def count(self, finite: bool) -> None:
        """Count a step, finite or not."""
        if finite:
            self.counts.nonfinite_in_a_row = 0
        else:
            self.counts.nonfinite_steps += 1
            self.counts.nonfinite_in_a_row += 1

    def state_dict(self) -> dict[str, Any]:
        """The counts, a pending step settled first: the checkpointer asks for them before it saves the schedules,
        the loss window's items (`ItemsSeen`) and the weights, so a checkpoint holds what the immediate path saves."""
        self.settle()
        return self.counts.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """The saved counts. A resumed run continues a streak cut short by a preemption; one that the guard itself
        stopped starts a new allowance (rerunning it is the user's decision to go on)."""
        self.counts.load_state_dict(saved)
        if self.gives_up():
            self.counts.nonfinite_in_a_row = 0

    def gives_up(self) -> bool:
        """max_nonfinite_in_a_row steps in a row were not finite: the run saves and stops (a step that could make
        it so is never left pending: `may_wait`)."""
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

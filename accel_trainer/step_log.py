"""What a training log record says, summed on the device between log steps and read back once per record.

Nothing is read back to the host except at log steps: the loss and the recipe's extra terms are summed on
the device (`Window`), and one reduction over the processes at a log step turns them into the record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator

from .config import TrainConfig
from .losses import LossOutput


@dataclass
class Window:
    """Device-side sums over the optimizer steps since the last log, read back only when logging."""

    loss_sum: torch.Tensor
    num_items: torch.Tensor  # items counted on the device: recipes that return num_items
    num_host_items: int = 0  # items of mean-loss recipes, known on the host without a sync
    num_steps: int = 0
    term_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's extra terms, like loss_sum
    started: float = field(default_factory=time.perf_counter)
    items_banked: float = 0.0  # items of this window already counted in the run's items_seen (by a save)

    @classmethod
    def empty(cls, device: torch.device) -> Window:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, output: LossOutput, weight: float = 1.0) -> None:
        """Add a micro-batch's loss and terms, each multiplied by `weight` (the batch size for batch means)."""
        self.loss_sum.add_(output.loss.detach().float(), alpha=weight)
        for name, value in output.terms.items():
            if name not in self.term_sums:
                self.term_sums[name] = torch.zeros_like(self.loss_sum)
            self.term_sums[name].add_(value.float(), alpha=weight)

    def bank_items(self, accelerator: Accelerator) -> float:
        """This window's items over all processes not counted yet, now counted (one reduction: at saves)."""
        total = accelerator.reduce(self.num_items.float(), reduction="sum").item()
        total += self.num_host_items * accelerator.num_processes
        new, self.items_banked = total - self.items_banked, total
        return new


def log_record(
    accelerator: Accelerator,
    cfg: TrainConfig,
    window: Window,
    step: int,
    epoch: int,
    lrs: list[float],
    grad_norm: Any,
) -> tuple[dict[str, Any], float]:
    """Read the window back (the only host synchronisation of a training step) and build a log record.

    Returns the record and the window's items not yet counted in the run's items_seen.
    """
    names = sorted(window.term_sums)  # the same terms on every process: the reduce needs equal shapes
    sums = [window.loss_sum, window.num_items.float(), *(window.term_sums[name] for name in names)]
    totals = accelerator.reduce(torch.stack(sums), reduction="sum").tolist()
    loss_sum, num_items = totals[:2]
    num_items += window.num_host_items * accelerator.num_processes  # every process ran equal micro-batches
    elapsed = time.perf_counter() - window.started
    record = {
        "step": step,
        "epoch": epoch,
        "loss": loss_sum / num_items,
        **{name: total / num_items for name, total in zip(names, totals[2:], strict=True)},
        "lr": lrs[0],
        **{f"lr/{index}": lr for index, lr in enumerate(lrs[1:], start=1)},
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "samples_per_s": window.num_steps * cfg.global_batch_size / elapsed,
        "step_time_s": elapsed / window.num_steps,
        "world_size": accelerator.num_processes,
    }
    return record, num_items - window.items_banked

"""What a training log record says, summed on the device between log steps and read back once per record.

Nothing is read back to the host except at log steps: the loss and the recipe's extra terms are summed on
the device (`Window`), and one reduction over the processes at a log step turns them into the record.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.losses import LossOutput
from accel_trainer.parallel.mesh import data_ranks


@dataclass
class Window:
    """Device-side sums over the optimizer steps since the last log, read back only when logging."""

    loss_sum: torch.Tensor
    num_items: torch.Tensor  # items counted on the device: recipes that return num_items
    num_host_items: int = 0  # items of mean-loss recipes, known on the host without a sync
    num_steps: int = 0
    term_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's extra terms, like loss_sum
    term_counts: dict[str, torch.Tensor] = field(default_factory=dict)  # of the terms with counts of their own
    started: float = field(default_factory=time.perf_counter)
    items_banked: float = 0.0  # items of this window already counted in the run's items_seen (by a save)
    data_wait_s: float = 0.0  # time spent waiting for the next micro-batch
    excluded_s: float = 0.0  # evaluation, checkpoint and FLOP-counting time: not training throughput

    @classmethod
    def empty(cls, device: torch.device) -> Window:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, output: LossOutput, weight: float = 1.0) -> None:
        """Add a micro-batch's loss and terms, each multiplied by `weight` (the batch size for batch means); a term
        with its own count is added as it is, and its count beside it."""
        self.loss_sum.add_(output.loss.detach().float(), alpha=weight)
        for name, value in output.terms.items():
            if name not in self.term_sums:
                self.term_sums[name] = torch.zeros_like(self.loss_sum)
            count = output.counts.get(name)
            self.term_sums[name].add_(value.float(), alpha=weight if count is None else 1.0)
            if count is not None:
                self.term_counts.setdefault(name, torch.zeros_like(self.loss_sum)).add_(count.float())

    def add_step(self, outputs: list[LossOutput], micro_batch_size: int) -> None:
        """Add the loss outputs of one step's micro-batches: item sums, or batch means weighted by their size.
        Training micro-batches are always full (the tail of an epoch is dropped), on every path."""
        for output in outputs:
            if output.num_items is not None:
                self.add(output)
                self.num_items += output.num_items.to(self.num_items.device, torch.float32)
            else:
                self.add(output, weight=micro_batch_size)
                self.num_host_items += micro_batch_size

    def elapsed(self) -> float:
        """Training time of this window: wall time since it started, less the excluded time."""
        return time.perf_counter() - self.started - self.excluded_s

    def bank_items(self, accelerator: Accelerator) -> float:
        """This window's items over all processes not counted yet, now counted (one reduction: at saves)."""
        ranks = data_ranks(accelerator)  # tensor-parallel ranks count the same items
        total = accelerator.reduce(self.num_items.float(), reduction="sum").item() / ranks.replicas
        total += self.num_host_items * ranks.size
        new, self.items_banked = total - self.items_banked, total
        return new


class ItemsSeen:
    """`items_seen`: the loss items (tokens for a token loss, samples otherwise) of the steps taken, over all
    processes (a step skipped as non-finite is not counted). The observer adds each window when it logs it; the
    checkpointer, with which this is registered, saves it with the open window's items counted too (a collective,
    as the save is), so a checkpoint between two records holds its own step's count."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.seen = 0.0
        self.window: Window | None = None  # the observer's open window

    def state_dict(self) -> dict[str, Any]:
        if self.window is not None and self.window.num_steps:  # a window just logged holds nothing: no collective
            self.seen += self.window.bank_items(self.accelerator)
        return {"items_seen": self.seen}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.seen = saved.get("items_seen", 0.0)


@dataclass
class Speed:
    """What turns samples per second into FLOPs and MFU; set once FLOPs per sample are counted."""

    flops_per_sample: float | None = None
    peak_tflops: float | None = None  # per device, in the compute dtype; None: no MFU


# The per-process values gathered at a log step, after the loss and the recipe's terms.
_PER_PROCESS = ("elapsed", "data_wait", "host_rss_gb", "mem_allocated_gb", "mem_reserved_gb")


def log_record(
    accelerator: Accelerator,
    cfg: TrainConfig,
    window: Window,
    step: int,
    epoch: int,
    figures: dict[str, Any],
    speed: Speed,
) -> tuple[dict[str, Any], float]:
    """Read the window back (the only host synchronisation of a training step) and build a log record.

    One gather brings every process's sums and timings to every process (the collective the step already
    paid for): losses are summed, times and memory taken at their maximum (a step is as slow as its slowest
    process). Returns the record and the window's items not yet counted in the run's items_seen.
    """
    names = sorted(window.term_sums)  # the same terms on every process: the gather needs equal shapes
    counted = sorted(window.term_counts)
    local = [window.elapsed(), window.data_wait_s, *_memory_gb(accelerator.device)]
    sums = [window.loss_sum, window.num_items.float(), *(window.term_sums[name] for name in names)]
    sums += [window.term_counts[name] for name in counted]
    stacked = torch.cat([torch.stack(sums), torch.tensor(local, device=window.loss_sum.device)])
    rows = accelerator.gather(stacked.double()).view(accelerator.num_processes, -1).tolist()
    ranks = data_ranks(accelerator)  # tensor-parallel ranks hold copies of their data-parallel rank's sums
    totals = [sum(column) / ranks.replicas for column in zip(*rows, strict=True)]
    loss_sum, num_items = totals[:2]
    num_items += window.num_host_items * ranks.size  # every data-parallel rank ran equal micro-batches
    terms = dict(zip(names, totals[2 : 2 + len(names)], strict=True))
    counts = dict(zip(counted, totals[2 + len(names) : len(sums)], strict=True))
    timing = {name: [row[len(sums) + i] for row in rows] for i, name in enumerate(_PER_PROCESS)}
    elapsed = max(timing["elapsed"])
    samples_per_s = window.num_steps * cfg.global_batch_size / elapsed
    record: dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "loss": loss_sum / num_items if num_items else None,  # None: every step of the window was non-finite
        **{name: _mean(total, counts.get(name, num_items)) for name, total in terms.items()},
        **_optimizer_figures(figures),
        "samples_per_s": samples_per_s,
        "items_per_s": num_items / elapsed,
        "step_time_s": elapsed / window.num_steps,
        "step_time_s_max": elapsed / window.num_steps,
        "step_time_s_min": min(timing["elapsed"]) / window.num_steps,
        "data_wait_frac": max(w / e for w, e in zip(timing["data_wait"], timing["elapsed"], strict=True)),
        "eta_s": (cfg.max_steps - step) * elapsed / window.num_steps,
        "world_size": accelerator.num_processes,
        "host_rss_gb": max(timing["host_rss_gb"]),
    }
    record.update(_device_figures(accelerator, timing, speed, samples_per_s))
    return record, num_items - window.items_banked


def _mean(total: float, count: float) -> float | None:
    """A logged term: its sum over its count, None where nothing was counted (every step non-finite)."""
    return total / count if count else None


def _device_figures(
    accelerator: Accelerator, timing: dict[str, list[float]], speed: Speed, samples_per_s: float
) -> dict[str, float]:
    """The peak device memory of the window (then reset: a peak per window), TFLOP/s and MFU where known."""
    figures = {}
    if accelerator.device.type == "cuda":
        figures["mem_allocated_gb"] = max(timing["mem_allocated_gb"])
        figures["mem_reserved_gb"] = max(timing["mem_reserved_gb"])
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    if speed.flops_per_sample is not None:
        figures["tflops"] = speed.flops_per_sample * samples_per_s / accelerator.num_processes / 1e12
        if speed.peak_tflops:
            figures["mfu"] = figures["tflops"] / speed.peak_tflops
    return figures


def _optimizer_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """The step's LRs and gradient norms as numbers, `lr` (the first optimizer's first group) and `grad_norm`
    first, whatever the optimizers (engine/stepper.py)."""
    values = {key: float(value) if value is not None else None for key, value in figures.items()}
    lr = values.pop("lr", next((value for key, value in values.items() if key.startswith("lr")), None))
    lrs = {key: value for key, value in values.items() if key.startswith("lr")}
    rest = {key: value for key, value in values.items() if key not in lrs and key != "grad_norm"}
    return {"lr": lr, **lrs, "grad_norm": values.get("grad_norm"), **rest}


def _memory_gb(device: torch.device) -> list[float]:
    """This process's peak host memory, and the device's peak allocated and reserved memory since the reset."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    if device.type != "cuda":
        return [host, 0.0, 0.0]
    return [host, torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30]

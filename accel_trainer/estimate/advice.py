"""Whether each rank fits a device of `--device_memory_gb`, and what would make the worst one fit.

A rank fits when its peak is at most 90% of the device's memory: the CUDA context (about 0.5 GB) and the
caching allocator's rounding and fragmentation take the rest. Where one does not fit, the advice estimates the
worst rank again with activation checkpointing and with halved micro-batches (the same global batch: more
accumulation steps, the same trajectory) and names the first that fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accel_trainer.errors import UserError
from accel_trainer.estimate.step_memory import RankMemory

USABLE = 0.9  # of the device's memory, for the tensors


def advice(
    estimated: list[RankMemory], device_gb: float, micro_batch_size: int, again: Callable[..., RankMemory]
) -> str:
    """One line per finding: every rank fits, or which do not and what would fit (`again(**changes)` estimates
    the worst rank with the changed settings)."""
    budget = device_gb * 1e9 * USABLE
    worst = max(estimated, key=lambda memory: memory.peak_bytes)
    if worst.peak_bytes <= budget:
        return (
            f"fits: every rank peaks at most {_size(worst.peak_bytes)} of {_size(device_gb * 1e9)}"
            f" ({worst.peak_bytes / (device_gb * 1e9):.0%}; {USABLE:.0%} is usable for tensors)"
        )
    over = [memory.rank for memory in estimated if memory.peak_bytes > budget]
    lines = [
        f"does not fit: rank(s) {_ranks(over)} peak at {_size(worst.peak_bytes)}, over {USABLE:.0%} of"
        f" {_size(device_gb * 1e9)}"
    ]
    state = worst.params_bytes + worst.grads_bytes + worst.optimizer_bytes
    if state > budget:
        lines.append(
            f"  the model's parameters, gradients and optimizer state alone take {_size(state)} a rank: shard"
            " them over more processes (more GPUs, on an FSDP layout if this is not one) or train a smaller model"
        )
        return "\n".join(lines)
    lines.append(_first_that_fits(budget, micro_batch_size, again))
    return "\n".join(lines)


def _first_that_fits(budget: float, micro_batch_size: int, again: Callable[..., RankMemory]) -> str:
    tried = []
    for changes in _candidates(micro_batch_size):
        try:
            memory = again(**changes)
        except UserError:  # a micro-batch that does not divide the global batch
            continue
        said = " ".join(f"{key}={value}" for key, value in changes.items())
        tried.append(f"{said}: {_size(memory.peak_bytes)}")
        if memory.peak_bytes <= budget:
            return f"  fits with {said} (peak {_size(memory.peak_bytes)})"
    return "  nothing tried fits (" + "; ".join(tried) + "): shard over more processes or shorten the sequences"


def _candidates(size: int) -> list[dict[str, Any]]:
    """Activation checkpointing alone, then halved micro-batches, each alone and with checkpointing."""
    halves = []
    while size > 1:
        size //= 2
        halves.append(size)
    plain = [{"micro_batch_size": half} for half in halves]
    checkpointed = [{"activation_checkpointing": "true", **change} for change in plain]
    return [{"activation_checkpointing": "true"}, *[c for pair in zip(plain, checkpointed, strict=True) for c in pair]]


def _size(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps the figure at least 1, as `--device_memory_gb` counts (a tiny
    model's peak read 0.00 GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} bytes"


def _ranks(ranks: list[int]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1))
        else (", ".join(map(str, ranks)))
    )

"""Batch arithmetic: how a layout-free global batch becomes micro-batches and accumulation steps.

`global_batch_size` (samples per optimizer step) and `micro_batch_size` (samples per process per forward
pass) are what a user sets; the accumulation steps follow from the number of processes. Because every
optimizer step consumes exactly one global batch, a run follows the same trajectory on any layout. The global
batch decides the trajectory, the micro-batch only the memory: a micro-batch size the user did not set (the
recipe's default) follows the layout, the largest not above it that splits the global batch over the
data-parallel ranks (`fit`); one the user set that cannot is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel_trainer.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split across processes and micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    num_processes: int
    accumulation_steps: int
    fitted_from: int = 0
    """The recipe's default micro-batch size when it did not split the global batch over these ranks and this
    plan's smaller one was taken instead (0: as asked)."""

    def steps_per_epoch(self, num_samples: int) -> int:
        """Optimizer steps in one pass over `num_samples`; the incomplete last global batch is skipped."""
        steps = num_samples // self.global_batch_size
        if steps == 0:
            raise ConfigError(
                f"the training set has {num_samples} samples, fewer than global_batch_size="
                f"{self.global_batch_size}; lower global_batch_size"
            )
        return steps


def plan_batches(global_batch_size: int, micro_batch_size: int, num_processes: int, *, fit: bool = False) -> BatchPlan:
    """Derive accumulation steps, or explain which sizes to change when they do not divide; `fit`: the micro-batch
    size is the recipe's default, which may be lowered to the largest that divides (the module's docstring)."""
    if global_batch_size <= 0 or micro_batch_size <= 0:
        raise ConfigError(
            f"global_batch_size={global_batch_size} and micro_batch_size={micro_batch_size} must be positive"
        )
    asked = micro_batch_size
    if fit:
        if global_batch_size % num_processes:  # no micro-batch size splits it: the ranks do not divide it
            above = global_batch_size + num_processes - global_batch_size % num_processes
            raise ConfigError(
                f"global_batch_size={global_batch_size} does not split over {num_processes} data-parallel rank(s):"
                f" pick a multiple of {num_processes} (such as {above})"
            )
        micro_batch_size = next(m for m in range(asked, 0, -1) if global_batch_size % (m * num_processes) == 0)
    per_step = micro_batch_size * num_processes
    if global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size={micro_batch_size}"
            f" x {num_processes} data-parallel rank(s) = {per_step}; "
            + _sizes_that_divide(global_batch_size, micro_batch_size, num_processes)
        )
    fitted_from = asked if micro_batch_size != asked else 0
    return BatchPlan(global_batch_size, micro_batch_size, num_processes, global_batch_size // per_step, fitted_from)


def planned_micro_batch_size(micro_batch_size: int | str) -> int:
    """The micro-batch size to plan with before training: the one set, or 1 for `auto`, whose size is found later
    (the global batch must already split over the data-parallel ranks)."""
    return 1 if micro_batch_size == "auto" else int(micro_batch_size)


def _sizes_that_divide(global_batch_size: int, micro_batch_size: int, num_processes: int) -> str:
    """The fix, with numbers: the nearest global batches that divide, and the largest smaller micro-batch that
    divides this one (none where the global batch does not split over the ranks at all)."""
    per_step = micro_batch_size * num_processes
    below, above = global_batch_size // per_step * per_step, (global_batch_size // per_step + 1) * per_step
    said = f"pick a global_batch_size divisible by {per_step}" + (f" ({below} or {above})" if below else "")
    smaller = [m for m in range(micro_batch_size - 1, 0, -1) if global_batch_size % (m * num_processes) == 0]
    return said + (f" or a smaller micro_batch_size that divides it: {smaller[0]}" if smaller else "")


def per_process_batch(global_batch_size: int, num_processes: int) -> int:
    """Samples per process per optimizer step: the largest micro-batch, with no accumulation.

    Raises:
        ConfigError: the global batch does not split evenly over the processes.
    """
    return plan_batches(global_batch_size, 1, num_processes).accumulation_steps


def halved_micro_batch(per_process: int, micro_batch_size: int) -> int:
    """The micro-batch to try after `micro_batch_size` ran out of memory: the largest divisor of the per-process
    batch that is at most half of it (so the accumulation steps stay whole and the global batch the same); 0
    when even 1 did not fit."""
    return next((size for size in range(micro_batch_size // 2, 0, -1) if per_process % size == 0), 0)

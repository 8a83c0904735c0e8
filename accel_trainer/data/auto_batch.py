"""`micro_batch_size=auto`: the largest micro-batch that fits in memory, found before training, with the global
batch (and so the trajectory) unchanged.

Every process tries a forward and backward pass of a real training micro-batch, starting from its whole
per-process batch (no accumulation), on the model before `accelerator.prepare`. accelerate's
`find_executable_batch_size` drives the search: on an out-of-memory error it clears the device cache and the
next size is tried, the largest divisor of the per-process batch at most half the last one
(`batching.halved_micro_batch`), so the accumulation steps stay whole. While a size is tried, placeholders the
size of AdamW's two moments and DDP's gradient buckets (three fp32 copies of the parameters) hold memory the
run will need. The processes then take the smallest size any of them found (one gather), and the accumulation
steps follow from it.

The probe leaves no trace: the RNG states and the model's buffers (BatchNorm statistics) are put back and the
gradients dropped, so the run is bitwise the one with that micro_batch_size set by hand. Each process probes an
unsharded copy of the model with no collective inside, so that one process running out of memory cannot leave
the others waiting in a collective: auto is refused on sharded (FSDP, tensor-parallel), pipeline and
context-parallel layouts, whose memory that copy would not measure.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, gather_object, send_to_device

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.contract.losses import read_loss_output
from accel_trainer.data import loaders
from accel_trainer.data.batching import halved_micro_batch, per_process_batch
from accel_trainer.data.rng import apply_rng_states, capture_rng_states
from accel_trainer.errors import ConfigError
from accel_trainer.parallel.mesh import DataRanks
from accel_trainer.recipe import Recipe


def check_auto_layout(accelerator: Accelerator, layout: LayoutSettings, ranks: DataRanks) -> None:
    """Refuse auto where an unsharded probe would not measure the run's memory.

    Raises:
        ConfigError: FSDP, tensor, pipeline or context parallelism.
    """
    kinds = {
        "an FSDP": accelerator.is_fsdp2,
        "a tensor-parallel": layout.tp_size > 1 or ranks.replicas > 1,
        "a pipeline": layout.pp_size > 1,
        "a context-parallel": ranks.context_parallel > 1,
    }
    kind = next((name for name, applies in kinds.items() if applies), None)
    if kind is not None:
        raise ConfigError(
            f"micro_batch_size=auto on {kind} layout: auto probes an unsharded copy of the model on each process,"
            " which does not measure this layout's memory; it works on one process and on DDP layouts. Set"
            " micro_batch_size (on CUDA, the size auto finds on one GPU fits here too: sharding only lowers each"
            " GPU's share)"
        )


def choose_micro_batch_size(
    recipe: Recipe,
    global_batch_size: int,
    model: torch.nn.Module,
    train_set: Any,
    accelerator: Accelerator,
    ranks: DataRanks,
) -> int:
    """The largest micro-batch every process can run (see the module docstring), said on the main process.

    Raises:
        ConfigError: not even one sample fits.
    """
    per_process = per_process_batch(global_batch_size, ranks.size)
    examples = loaders.first_examples(train_set, per_process)
    size = per_process

    def next_size() -> int:
        nonlocal size
        size = halved_micro_batch(per_process, size)
        return size

    @find_executable_batch_size(starting_batch_size=per_process, reduce_batch_size_fn=next_size)
    def largest_that_fits(micro_batch_size: int) -> int:
        _forward_backward(recipe, model, examples[:micro_batch_size], accelerator)
        return micro_batch_size

    model.to(accelerator.device)
    rng_states, buffers = capture_rng_states(), [buffer.clone() for buffer in model.buffers()]
    try:
        fits = largest_that_fits()
    except RuntimeError as error:  # accelerate's "reached zero"
        raise ConfigError(f"micro_batch_size=auto: not even one sample fits in memory ({error})") from None
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, kept in zip(model.buffers(), buffers, strict=True):
                buffer.copy_(kept)
        apply_rng_states(rng_states)
    chosen = min(gather_object([fits])) if accelerator.num_processes > 1 else fits
    if accelerator.is_main_process:
        print(f"micro_batch_size=auto: {chosen} of {per_process} samples per process fit in one pass", flush=True)
    return chosen


def _forward_backward(recipe: Recipe, model: torch.nn.Module, examples: list[Any], accelerator: Accelerator) -> None:
    """One training micro-batch's forward and backward, with the optimizer's and DDP's memory held aside."""
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    placeholders = torch.empty(3 * parameters, dtype=torch.float32, device=accelerator.device)
    batch = send_to_device(recipe.collate(examples), accelerator.device)
    with accelerator.autocast():
        loss = read_loss_output(recipe.compute_loss(model, batch)).loss
    loss.backward()
    del placeholders, batch, loss
    model.zero_grad(set_to_none=True)

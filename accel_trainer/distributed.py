"""Creating the Accelerator for whatever layout the launcher set up.

The hardware layout comes only from the launcher (an accelerate config file, torchrun, or nothing for one
process); this module turns it into an `Accelerator`, makes CPU multi-process runs really distributed, and
checks that the processes that started form the world that was asked for.
"""

from __future__ import annotations

from datetime import timedelta

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

from . import accelerate_fixes
from .config import TrainConfig


def build_accelerator(cfg: TrainConfig) -> Accelerator:
    """An Accelerator for the current launch, with accumulation driven by the loop.

    Accumulation counts micro-batches, not the data loader (`sync_with_dataloader=False`): syncing with the
    loader made AdamW take extra steps at epoch ends (accelerate #1847). The seedable sampler makes the data
    order a function of seed and epoch alone, the same on any number of processes. The caller sets
    `gradient_accumulation_steps` once the process count is known.
    """
    accelerate_fixes.refuse_single_process_cpu_launch()
    accelerator = Accelerator(
        cpu=accelerate_fixes.wants_cpu(),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s))],
        step_scheduler_with_optimizer=False,
    )
    accelerate_fixes.check_launched_world(accelerator.num_processes)
    return accelerator

"""BatchNorm running statistics that are the same on every process, so eval metrics are the saved model's.

Each process updates its BatchNorm running mean and variance from its own micro-batches. DDP then
broadcasts process 0's buffers at every forward, and FSDP keeps each process's own, so an evaluation ran
with statistics that differ from process to process while a checkpoint saved process 0's: under FSDP the
reported eval accuracy (0.7723) was not the saved model's (0.7624). Like timm's `distribute_bn`, the
floating-point running statistics are averaged over the processes before each evaluation and each save.

`sync_batchnorm=true` instead normalises with the statistics of the whole global micro-batch in training
(torch's SyncBatchNorm); it needs CUDA and NCCL, and is refused elsewhere.
"""

from __future__ import annotations

import warnings

import torch
from accelerate import Accelerator
from torch.nn.modules.batchnorm import _BatchNorm

from accel_trainer.errors import ConfigError
from accel_trainer.parallel.sharding import pipeline_size


def average_running_stats(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Average every BatchNorm's floating-point running statistics over the processes (one all-reduce); a
    pipeline's processes hold different layers, and see the same batches: nothing to average."""
    if accelerator.num_processes == 1 or pipeline_size(accelerator) > 1:
        return
    buffers = [
        buffer
        for module in model.modules()
        if isinstance(module, _BatchNorm) and module.track_running_stats
        for buffer in (module.running_mean, module.running_var)
        if buffer is not None and buffer.is_floating_point()
    ]
    if not buffers:
        return
    flat = torch.cat([buffer.detach().reshape(-1).float() for buffer in buffers])
    averaged = accelerator.reduce(flat, reduction="mean")
    offset = 0
    with torch.no_grad():
        for buffer in buffers:
            buffer.copy_(averaged[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


def convert_to_sync_batchnorm(
    model: torch.nn.Module, accelerator: Accelerator, is_main_process: bool
) -> torch.nn.Module:
    """The model with SyncBatchNorm layers, when `sync_batchnorm=true` can work here.

    Raises:
        ConfigError: not on CUDA devices (torch's SyncBatchNorm runs only there).
    """
    if accelerator.device.type != "cuda":
        raise ConfigError(
            f"sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm runs on NCCL), not {accelerator.device.type};"
            " leave it off: running statistics are averaged over the processes before each evaluation and save"
        )
    if accelerator.num_processes == 1:
        if is_main_process:
            warnings.warn("accel-trainer: sync_batchnorm=true has no effect on one process", stacklevel=2)
        return model
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

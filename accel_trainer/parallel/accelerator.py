"""Creating the Accelerator for whatever layout the launcher set up.

The hardware layout comes only from the launcher (an accelerate config file, torchrun, or nothing for one
process); this module turns it into an `Accelerator`, makes CPU multi-process runs (DDP and FSDP) really
distributed, applies the DDP and gradient-scaler settings of the config, and checks that the processes that
started form the world that was asked for.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)

from accel_trainer.config.layout import LayoutSettings, settings_file_of
from accel_trainer.config.train_config import TrainConfig, resolve_settings
from accel_trainer.contract.quantization import kept_out_of_ddp, on_the_plain_tensors_device
from accel_trainer.errors import ConfigError, LayoutError
from accel_trainer.parallel import launch_fixes
from accel_trainer.parallel.compiling import dynamo_plugin
from accel_trainer.parallel.float8 import check_float8, check_optimizers_hold_the_model, float8_handlers
from accel_trainer.parallel.layout_file import Layout, layout_environment, layout_path_from_environment
from accel_trainer.parallel.mesh import DataRanks, mesh_shape, set_up_mesh
from accel_trainer.parallel.pipeline.stages import Pipeline

_DDP_TYPES = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
SUPPORTED_LAYOUTS = (DistributedType.NO, *_DDP_TYPES, DistributedType.FSDP)


def build_accelerator(cfg: TrainConfig, layout: LayoutSettings) -> Accelerator:
    """An Accelerator for the current launch, with accumulation driven by the loop.

    Accumulation counts micro-batches, not the data loader (`sync_with_dataloader=False`): syncing with the
    loader made AdamW take extra steps at epoch ends (accelerate #1847). The seedable sampler makes the data
    order a function of seed and epoch alone, the same on any number of processes. The caller sets
    `gradient_accumulation_steps` once the process count is known.
    """
    if (launch_fixes.launched_world_size() or 1) == 1 and not torch.distributed.is_initialized():
        launch_fixes.forget_accelerate_state()  # a second at.train() in one process may change any setting
    launch_fixes.refuse_single_process_cpu_launch()
    launch_fixes.init_process_group_per_attempt(layout.collective_timeout_s)
    fsdp_plugin = launch_fixes.fsdp_plugin_from_launcher()
    check_float8(layout, fsdp_plugin)
    with launch_fixes.parallelism_config_hidden():  # mesh.set_up_mesh gives it to accelerate below
        accelerator = _accelerator(cfg, layout, fsdp_plugin)
    launch_fixes.check_launched_world(accelerator.num_processes)
    launch_fixes.enable_fsdp_on_cpu(accelerator, fsdp_plugin)
    check_supported(accelerator.distributed_type)
    check_fsdp_options(getattr(accelerator.state, "fsdp_plugin", None))
    set_up_mesh(accelerator, layout)
    warn_about_ineffective_settings(cfg, layout, accelerator)
    return accelerator


def _accelerator(
    cfg: TrainConfig, layout: LayoutSettings, fsdp_plugin: FullyShardedDataParallelPlugin | None
) -> Accelerator:
    return Accelerator(
        cpu=launch_fixes.wants_cpu(),
        fsdp_plugin=fsdp_plugin,
        dynamo_plugin=dynamo_plugin(layout),
        mixed_precision=layout.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False),
        # non_blocking: a CUDA batch is copied from pinned memory (data.train_loader) while the GPU still works.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=True),
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=layout.collective_timeout_s)),
            ddp_kwargs(layout),
            GradScalerKwargs(init_scale=layout.fp16_init_scale, growth_interval=layout.fp16_growth_interval),
            *float8_handlers(layout, fsdp_plugin),
        ],
        step_scheduler_with_optimizer=False,
    )


def check_supported(distributed_type: DistributedType) -> None:
    """Refuse layouts the loop does not drive exactly (its step verbs, checkpoints and loss scaling).

    DeepSpeed steps the optimizer inside `backward` and keeps its own checkpoints; XLA and Megatron-LM have
    their own step paths. Rather than half-work there, they are a one-line error.
    """
    if distributed_type not in SUPPORTED_LAYOUTS:
        raise LayoutError(
            f"accel-trainer trains on one device, with DDP or with FSDP2, not with {distributed_type.value};"
            " launch with one of accelerate_configs/*.yaml (for sharding, an FSDP one such as 4gpu_fsdp.yaml)"
        )


def check_fsdp_options(plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Refuse FSDP options of the accelerate config that would be a second switch or would do nothing.

    Raises:
        LayoutError: naming the option and the one setting that does the job.
    """
    if plugin is None:
        return
    if plugin.activation_checkpointing:
        raise LayoutError(
            "fsdp_activation_checkpointing in the accelerate config would wrap the blocks a second time: set it"
            " to false and use the layout setting activation_checkpointing=true (the same on every layout)"
        )
    state_dict_type = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)
    if state_dict_type not in (None, "SHARDED_STATE_DICT"):
        raise LayoutError(
            f"fsdp_state_dict_type: {state_dict_type} has no effect in accel-trainer, whose FSDP checkpoints are"
            " always sharded (resharded on load, on any layout) and whose final/model.safetensors is always"
            " full: set fsdp_state_dict_type: SHARDED_STATE_DICT or remove it"
        )


def ddp_kwargs(layout: LayoutSettings) -> DistributedDataParallelKwargs:
    """DDP construction options and gradient-compression hook from the layout settings (used only under DDP)."""
    hooks = {
        "none": DDPCommunicationHookType.NO,
        "fp16": DDPCommunicationHookType.FP16,
        "bf16": DDPCommunicationHookType.BF16,
        "powersgd": DDPCommunicationHookType.POWER_SGD,
        "batched_powersgd": DDPCommunicationHookType.BATCHED_POWER_SGD,
    }
    state = {}
    if "powersgd" in layout.ddp_comm_hook:
        if layout.ddp_powersgd_start_step < 2:
            raise ConfigError(f"ddp_powersgd_start_step={layout.ddp_powersgd_start_step}: PowerSGD needs at least 2")
        state = {
            "matrix_approximation_rank": layout.ddp_powersgd_rank,
            "start_powerSGD_iter": layout.ddp_powersgd_start_step,
        }
    return DistributedDataParallelKwargs(
        find_unused_parameters=layout.ddp_find_unused_parameters,
        static_graph=layout.ddp_static_graph,
        bucket_cap_mb=layout.ddp_bucket_cap_mb,
        gradient_as_bucket_view=layout.ddp_gradient_as_bucket_view,
        comm_hook=hooks[layout.ddp_comm_hook],
        comm_state_option=state,
    )


def warn_about_ineffective_settings(cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator) -> None:
    """Warn once, on the main process, about settings the current hardware or layout ignores."""
    defaults = LayoutSettings()
    ignored = []
    if accelerator.distributed_type not in _DDP_TYPES:
        ignored += [
            name
            for name in vars(layout)
            if name.startswith("ddp_") and getattr(layout, name) != getattr(defaults, name)
        ]
        ignored = [f"{name} (the layout is {accelerator.distributed_type.value}, not DDP)" for name in ignored]
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        ignored.append("mixed_precision=fp16 (accelerate runs fp32 on the CPU; bf16 works there)")
    elif accelerator.mixed_precision != "fp16":
        ignored += [
            f"{name} (mixed precision is {accelerator.mixed_precision}, not fp16)"
            for name in ("fp16_init_scale", "fp16_growth_interval")
            if getattr(layout, name) != getattr(defaults, name)
        ]
    if accelerator.is_main_process:
        for setting in ignored:
            warnings.warn(f"accel-trainer: {setting} has no effect here", stacklevel=2)


def launch_settings_file() -> Path | None:
    """The settings file beside the layout `layout=` named (its launcher names the file to the workers in
    ACCEL_TRAINER_LAYOUT: parallel/layout_file.py), if there is one."""
    config = layout_path_from_environment()
    if config is None:
        return None
    settings = settings_file_of(config)
    return settings if settings.is_file() else None


def settings_on_layout(
    config_cls: type[TrainConfig], layout: Layout, config_file: str | None, overrides: dict[str, Any]
) -> tuple[TrainConfig, LayoutSettings]:
    """What a run on `layout` would resolve (its settings file included), from a process that is not one of the
    layout's: its refusals (an unknown key, a bad value, a malformed or missing file), said before any starts."""
    with layout_environment(layout):
        return resolve_settings(config_cls, config_file, dict(overrides), launch_settings_file())


def data_parallel_size_on_layout(settings: LayoutSettings, layout: Layout) -> int | None:
    """The data-parallel ranks a run on `layout` would have (what its batch plan divides by), from a process that
    is not one of the layout's; None where the layout's sizes are refused: its processes say why."""
    is_fsdp = layout_uses(layout, "FSDP")
    with layout_environment(layout):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            return mesh_shape(settings, layout.num_processes, is_fsdp, device_type).data_parallel_size
        except LayoutError:
            return None


def layout_uses(layout: Layout, kind: str) -> bool:
    """Whether `layout`'s processes would run accelerate's `kind` (FSDP, DEEPSPEED), from a process that is not
    one of them: the ACCELERATE_USE_<kind> its launch sets."""
    with layout_environment(layout):
        return os.environ.get(f"ACCELERATE_USE_{kind}", "").lower() == "true"


def settings_note() -> str:
    """For the run's header: the settings file the run read; or, under a plain `accelerate launch --config_file F`
    (which does not tell its workers which file it read), that F.settings.yaml is read only with layout=F."""
    settings = launch_settings_file()
    if settings is not None:
        return f", settings {settings.name}"
    if layout_path_from_environment() is None and "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # accelerate launch's
        return " (no layout= named: a FILE.settings.yaml beside the accelerate config is read with layout=FILE)"
    return ""


def prepare_for_training(
    accelerator: Accelerator, pipeline: Pipeline | None, ranks: DataRanks, *objects: Any
) -> tuple[Any, ...]:
    """`accelerator.prepare` the model, optimizers and loaders; a None loader (a stream, no eval set) stays None."""
    model, *optimizers, train_loader, eval_loader = objects
    if pipeline is not None:  # not wrapped (there is no gradient to average); loaders for the data ranks
        (optimizer,) = optimizers  # several are refused on a pipeline layout (optim/optimizers.py)
        optimizer = accelerator.prepare_optimizer(optimizer)  # alone: prepare() refuses that under FSDP2
        if train_loader is not None:
            train_loader = launch_fixes.prepare_loader_for_data_ranks(accelerator, train_loader, ranks.rank, ranks.size)
        return model, optimizer, train_loader, eval_loader
    # On the CPU a batch is already where it belongs: no device placement (a send_to_device walk per step).
    placement = False if accelerator.device.type == "cpu" else None
    kept_out_of_ddp(model)
    prepared = accelerator.prepare(*objects, device_placement=[None] * (1 + len(optimizers)) + [placement] * 2)
    on_the_plain_tensors_device(prepared[0])
    if accelerator.ao_recipe_handler is not None:  # fp8 (parallel/float8.py)
        check_optimizers_hold_the_model(prepared[0], prepared[1 : 1 + len(optimizers)])
    return tuple(prepared)

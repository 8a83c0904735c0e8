"""Layout settings: how this run uses its hardware, kept apart from what it trains.

A recipe's config (`TrainConfig` and the recipe's subclass) says what to train and for how long, and is the
same on every layout. These settings say how the hardware at hand runs it: precision, the fp16 scaler, DDP
options and gradient compression, timeouts, activation checkpointing, SyncBatchNorm. They are not config
fields, so a recipe cannot inherit or default them (a recipe that declares one is refused). Lowest
precedence first, they come from:

    defaults < the layout's settings file < `--config file.yaml` < `key=value` overrides

The layout's settings file sits beside the accelerate config that `layout=` names, named
`<config>.settings.yaml` (`accelerate_configs/4gpu_ddp_powersgd.yaml` ->
`accelerate_configs/4gpu_ddp_powersgd.settings.yaml`), and every launcher's workers read it (accelerate refuses
unknown keys in its own file, and does not tell the workers which file it read: a plain `accelerate launch
--config_file` without layout= reads no settings file, and the run's header says so: parallel/accelerator.py's
launch_settings_file and settings_note). Key=value overrides work under every launcher.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from accel_trainer.errors import ConfigError

SETTINGS_SUFFIX = ".settings.yaml"


@dataclass
class LayoutSettings:
    """How the current hardware runs the recipe; the same recipe config runs on any layout."""

    mixed_precision: Literal["no", "bf16", "fp16", "fp8"] | None = None
    """Autocast precision; None takes the launcher's setting (the accelerate config), which defaults to no. fp8:
    float8 matrix products through torchao on CUDA GPUs of compute capability 8.9+ (parallel/float8.py)."""
    fp16_init_scale: float = 65536.0
    """Initial loss scale of the fp16 gradient scaler."""
    fp16_growth_interval: int = 2000
    """Optimizer steps without inf/NaN gradients before the fp16 loss scale doubles."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for a peer before the run fails instead of hanging."""
    activation_checkpointing: bool = False
    """Recompute each wrap_classes block's activations in backward: less memory, about a third more compute."""
    sync_batchnorm: bool = False
    """Normalise BatchNorm with the statistics of all processes' micro-batches (SyncBatchNorm; CUDA only)."""
    tp_size: int = 1
    """Tensor-parallel processes per model replica (the recipe's tp_plan splits its layers over them); or
    parallelism_config_tp_size in an FSDP layout's accelerate config (parallel/mesh.py)."""
    pp_size: int = 1
    """Pipeline stages the model is cut into, one group of blocks per process (parallel/pipeline/stages.py); the
    layout's processes are pp_size, or a multiple of it on an FSDP layout (each stage sharded over the rest)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"] = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining); the interleaved and looped ones give each process two
    stages, which needs at least 2 x pp_size - 1 blocks."""
    pp_microbatches: int = 0
    """Slices of each micro-batch that flow through the pipeline (more: smaller bubbles, smaller matrices);
    0 takes the number of stages. Must divide micro_batch_size."""
    compile: bool = False
    """torch.compile through accelerate's regional compilation (parallel/compiling.py): each repeated block compiled
    once and reused; the first steps pay the compilation, later ones run the compiled code. The accelerate config's
    dynamo_config (dynamo_backend) turns it on too. Not with tensor or pipeline parallelism yet."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device in the compute dtype, for MFU; 0 takes the datasheet table (GPUs only)."""
    ddp_find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step (costs a graph traversal per step)."""
    ddp_static_graph: bool = False
    """DDP: the set of used parameters never changes, which lets DDP overlap more communication."""
    ddp_bucket_cap_mb: int = 25
    """DDP: size in MB of the gradient buckets all-reduced together."""
    ddp_gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the communication buckets, saving one gradient-sized copy."""
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd", "batched_powersgd"] = "none"
    """DDP gradient compression: all-reduce in fp16 or bf16, or PowerSGD low-rank compression."""
    ddp_powersgd_rank: int = 1
    """PowerSGD: rank of the low-rank gradient approximation (higher: more exact, more traffic)."""
    ddp_powersgd_start_step: int = 10
    """PowerSGD: optimizer steps of plain all-reduce before compression starts (at least 2)."""


LAYOUT_KEYS = frozenset(f.name for f in dataclasses.fields(LayoutSettings))


def settings_file_of(accelerate_config: Path) -> Path:
    """Where the layout settings of an accelerate config file live: beside it, `<stem>.settings.yaml`."""
    return accelerate_config.with_name(accelerate_config.stem + SETTINGS_SUFFIX)


def split_layout_values(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `key: value` pairs into the recipe config's and the layout's."""
    config = {key: value for key, value in values.items() if key not in LAYOUT_KEYS}
    layout = {key: value for key, value in values.items() if key in LAYOUT_KEYS}
    return config, layout


def refuse_layout_fields(config_cls: type) -> None:
    """A recipe config may not declare a layout setting: it would default the hardware axis for every layout.

    Raises:
        ConfigError: naming the field and what to do instead.
    """
    clashes = sorted(LAYOUT_KEYS & {f.name for f in dataclasses.fields(config_cls)})
    if clashes:
        raise ConfigError(
            f"{config_cls.__qualname__} declares {', '.join(clashes)}, which {'is a' if len(clashes) == 1 else 'are'}"
            " layout setting(s): remove the field; set it per layout in <accelerate config>.settings.yaml or as"
            " key=value"
        )


def layout_to_dict(settings: LayoutSettings) -> dict[str, Any]:
    return dataclasses.asdict(settings)

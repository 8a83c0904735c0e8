"""The recipe's training configuration (what to train, how long), and how a run's settings are resolved.

A run's configuration is one dataclass: `TrainConfig` for the framework's fields, extended by each recipe
with its own fields and defaults. How the hardware runs it is a separate group, the layout settings
(config/layout.py), which a recipe cannot default. Both are resolved in one fixed order, lowest precedence first:

    field defaults < the recipe's Config defaults < the layout's settings file (layout settings only)
                   < `--config file.yaml` < `key=value` overrides

A `--config` file and the overrides may hold keys of both groups; typing and unknown-key hints are in
config/fields.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from accel_trainer.config.fields import check_values, config_fields, load_config_file, parse_duration, parse_steps
from accel_trainer.config.layout import LayoutSettings, layout_to_dict, refuse_layout_fields
from accel_trainer.errors import ConfigError


@dataclass
class TrainConfig:
    """Framework fields shared by every recipe; recipes subclass it to add fields and change defaults."""

    seed: int = 0
    """Seed of model initialisation, data order and random streams. Dropout and sampling streams differ per
    process, so only runs without them follow the same trajectory on every layout."""
    max_steps: int = 1000
    """Number of optimizer steps to train for."""
    global_batch_size: int = 64
    """Samples per optimizer step, summed over all processes and accumulation micro-batches."""
    micro_batch_size: int | Literal["auto"] = 32
    """Samples per process per forward pass; accumulation steps are derived from it and the process count. Left at
    the recipe's default, it follows the layout: the largest not above it that splits global_batch_size over the
    data-parallel ranks (data/batching.py). auto: the largest that fits in memory, halved from the whole
    per-process batch until one fits (data/auto_batch.py)."""
    lr: float = 1e-3
    """Peak learning rate (before the optional scaling rule)."""
    lr_schedule: Literal[
        "cosine", "linear", "constant", "warmup_stable_decay", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
        "cosine_with_restarts", "polynomial", "inverse_sqrt", "constant_with_warmup",
    ] = "cosine"  # fmt: skip
    """Decay after warmup: cosine or linear down to min_lr_ratio * lr, or constant; the others are transformers'
    schedules of those names (get_scheduler), warmup_stable_decay's decay the last decay_steps steps."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the decay, as a fraction of the peak (cosine, linear, warmup_stable_decay and the
    *_with_min_lr schedules)."""
    decay_steps: int = 0
    """warmup_stable_decay: the last this many steps decay (0: a tenth of max_steps)."""
    optimizer: Literal["adamw", "adafactor", "muon", "sgd"] = "adamw"
    """The default optimizer, torch's: AdamW; Adafactor; Muon for the 2-D weights of linear layers (not the
    embeddings nor a transformers model's output head) with AdamW for the rest; SGD with momentum."""
    momentum: float = 0.9
    """sgd's momentum (Nesterov); muon's own is 0.95."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr by global_batch_size / reference_batch_size (linear) or its square root (sqrt)."""
    reference_batch_size: int = 0
    """Global batch size at which lr was tuned; required when lr_scaling is not none."""
    weight_decay: float = 0.0
    """The optimizer's weight decay, applied to matrices and embeddings but not to biases and norm gains."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    log_every_steps: int = 10
    """Log training metrics every this many optimizer steps (0: only the last step)."""
    eval_every_steps: int = 0
    """Evaluate every this many optimizer steps; 0 evaluates only at the end."""
    sanity_eval: bool = True
    """Run the recipe's eval metrics on one eval batch before the first step, so that a broken metric is a one-line
    error at the start of a run, not after it (as Lightning's sanity check); false skips it."""
    eval_tasks: tuple[str, ...] = ()
    """lm-evaluation-harness tasks scored at each evaluation too, comma-separated names or task .yaml files, logged as
    lm_eval/<task>/<metric>: a transformers causal LM on the main process, which holds it whole (not FSDP)."""
    output_dir: str = ""
    """Run folder; empty means outputs/<recipe>/<date-time>. Set it to resume or restart a run."""
    resume: str = "auto"
    """auto: continue from output_dir's newest complete checkpoint, if any; none: start fresh; or a checkpoint path."""
    save_every_steps: int = 0
    """Save a checkpoint every this many optimizer steps; 0 saves only at the end and on preemption."""
    keep_last: int = 3
    """Keep the newest this many checkpoints (0 keeps all); the newest complete one is never deleted."""
    keep_best_metric: str = ""
    """Also keep the checkpoint with the best value of this eval metric (e.g. eval/loss); empty: off."""
    keep_best_mode: Literal["min", "max"] = "min"
    """Whether the best keep_best_metric is the smallest or the largest."""
    async_save: bool = False
    """Write checkpoints in the background from a snapshot in host memory, on every layout."""
    num_dataloader_workers: int = 0
    """Worker processes per data loader; 0 loads batches in the training process."""
    num_prefetch_batches: int = 0
    """Training micro-batches a background thread builds ahead while the step computes (paused while evaluating;
    up to N+2 built ahead; a stream is read ahead in whole steps, its checkpoints keeping the training's position).
    Building a batch must draw nothing from global random generators (a draw in each epoch's first batches is
    refused) nor read training state; 0: built in the step."""
    stream_split: Literal["auto", "shards", "off"] = "auto"
    """A sharded training stream: auto reads it as gcd(shards, global_batch_size) logical readers, each process the
    readers its share of a step spans, the same batches on any process count (one reader: read whole); shards: each
    process its own readers, else an error; off: every process reads it all, in another order than auto's."""
    early_stop_metric: str = ""
    """Stop when this eval metric (e.g. eval/loss) has not improved for early_stop_patience evaluations; the run
    saves a checkpoint and ends normally. Empty: never stop early."""
    early_stop_patience: int = 3
    """Evaluations without an improvement before an early stop."""
    early_stop_mode: Literal["min", "max"] = "min"
    """Whether lower (loss) or higher (accuracy) values of early_stop_metric are better."""
    early_stop_min_delta: float = 0.0
    """The smallest change of early_stop_metric that counts as an improvement."""
    max_time: str = ""
    """Wall-clock budget of the run, e.g. 2h30m, 90m or 45s: once spent, it saves a checkpoint and exits with
    status 75 like a preemption, so a scheduler can chain jobs (the same command continues with a new budget)."""
    skip_nonfinite_steps: bool = True
    """Check every step's loss and gradient norm (one host read per step) and skip a step where either is NaN or
    Inf, counting it as nonfinite_steps (stopping/nonfinite.py); false: no check, no per-step read."""
    max_nonfinite_in_a_row: int = 5
    """Non-finite steps in a row after which the run saves a checkpoint of the last finite weights and stops with
    an error; 1 stops at the first."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights (fp32, sharded like the model), updated after every
    optimizer step with this decay, e.g. 0.999; saved in checkpoints, exported to final/ema/. 0: none."""
    evaluate_ema: bool = False
    """Also evaluate the EMA weights at each evaluation, logged as eval_ema/<metric> (needs ema_decay)."""
    data_cache_gb: float = 1.0
    """Memory per process for holding a map-style set's columns as tensors and reading each micro-batch in
    one indexing (data/columns.py; with the default collate only); 0 reads and collates row by row."""
    show_progress_bar: bool = True
    """Show a tqdm progress bar on the main process."""
    report: bool = True
    """Write report.md and report.png into the run folder at the end (`accel-trainer report RUN` writes them
    later); false saves 0.5-1 s of drawing per run, e.g. in a sweep or a test suite."""
    profile_steps: str = ""
    """Profile these optimizer steps, e.g. 5-8: chrome traces, op tables (and CUDA memory) in <run>/profile."""
    trackers: tuple[str, ...] = ()
    """Experiment trackers mirroring metrics.jsonl, comma-separated: tensorboard, wandb, mlflow, trackio, ..."""
    tracker_project: str = ""
    """The trackers' project (W&B, trackio) or experiment (MLflow) of the run: empty, the recipe's name. Each run
    folder is one tracker run in it, named after the folder."""


def resolve_settings(
    config_cls: type[TrainConfig],
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    layout_file: Path | None = None,
) -> tuple[TrainConfig, LayoutSettings]:
    """Build the run's config and layout settings, each value checked and typed, in precedence order.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or out of range, a recipe config that
            declares a layout setting, or a recipe config key in the layout's settings file.
    """
    refuse_layout_fields(config_cls)
    config_values: dict[str, Any] = {}
    layout_values: dict[str, Any] = {}
    if layout_file is not None:
        from_layout = load_config_file(layout_file)
        misplaced = sorted(set(map(str, from_layout)) & set(config_fields(config_cls)))
        if misplaced:
            raise ConfigError(
                f"{misplaced[0]} in {layout_file} is a recipe config key, not a layout setting: set it with"
                " --config or key=value"
            )
        (typed,) = check_values((LayoutSettings,), from_layout, f"in {layout_file}")
        layout_values.update(typed)
    sources = [(load_config_file(config_file), f"in {config_file}")] if config_file is not None else []
    for values, where in [*sources, (dict(overrides or {}), "in overrides")]:
        typed_config, typed_layout = check_values((config_cls, LayoutSettings), values, where)
        config_values.update(typed_config)
        layout_values.update(typed_layout)
    config, layout = config_cls(**config_values), LayoutSettings(**layout_values)
    validate_config(config)
    validate_config(layout)
    return config, layout


def resolve_config(
    config_cls: type[TrainConfig],
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """The recipe config half of `resolve_settings` (layout keys are still checked)."""
    return resolve_settings(config_cls, config_file, overrides)[0]


# The smallest value each framework field accepts, and whether the bound itself is allowed. A count below
# it would not fail later: max_steps=-5 trained nothing and exited 0.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "max_steps": (1, True),
    "decay_steps": (0, True),
    "momentum": (0, True),
    "global_batch_size": (1, True),
    "micro_batch_size": (1, True),
    "warmup_steps": (0, True),
    "log_every_steps": (0, True),
    "eval_every_steps": (0, True),
    "save_every_steps": (0, True),
    "keep_last": (0, True),
    "num_dataloader_workers": (0, True),
    "num_prefetch_batches": (0, True),
    "data_cache_gb": (0, True),
    "early_stop_patience": (1, True),
    "early_stop_min_delta": (0, True),
    "reference_batch_size": (0, True),
    "lr": (0, True),
    "weight_decay": (0, True),
    "max_grad_norm": (0, True),
    "min_lr_ratio": (0, True),
    "collective_timeout_s": (0, False),
    "fp16_init_scale": (0, False),
    "peak_tflops": (0, True),
    "max_nonfinite_in_a_row": (1, True),
    "ema_decay": (0, True),
    "fp16_growth_interval": (1, True),
    "ddp_bucket_cap_mb": (1, True),
    "ddp_powersgd_rank": (1, True),
}


def validate_config(config: TrainConfig | LayoutSettings) -> None:
    """Check the framework fields' ranges up front, so a bad value is a one-line error before any work.

    Raises:
        ConfigError: naming the field, its value and the range it must be in.
    """
    for name, (bound, inclusive) in _LOWER_BOUNDS.items():
        if not hasattr(config, name):  # the bounds cover the config and the layout settings
            continue
        value = getattr(config, name)
        if isinstance(value, str):  # micro_batch_size=auto
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value}: expected a finite number")
        if value < bound or (value == bound and not inclusive):
            relation = "at least" if inclusive else "more than"
            raise ConfigError(f"{name}={value}: must be {relation} {bound}")
    if isinstance(config, TrainConfig):
        _check_training(config)


def _check_training(config: TrainConfig) -> None:
    """validate_config's checks of a TrainConfig's values that no lower bound says."""
    parse_steps(config.profile_steps)  # raises its own one-line error
    if config.max_time:
        parse_duration(config.max_time)  # a one-line error now, not after the setup
    if config.lr_schedule == "warmup_stable_decay" and config.warmup_steps + wsd_decay_steps(config) > config.max_steps:
        raise ConfigError(
            f"warmup_steps={config.warmup_steps} + decay_steps={wsd_decay_steps(config)} > max_steps="
            f"{config.max_steps}: warmup_stable_decay would have no stable phase; shorten them"
        )
    if config.min_lr_ratio > 1:
        raise ConfigError(f"min_lr_ratio={config.min_lr_ratio}: must be at most 1 (a fraction of the peak lr)")
    if config.ema_decay >= 1:
        raise ConfigError(f"ema_decay={config.ema_decay}: must be below 1 (1 would never move), e.g. 0.999")
    if config.evaluate_ema and not config.ema_decay:
        raise ConfigError("evaluate_ema=true needs EMA weights to evaluate: set ema_decay too, e.g. 0.999")


def wsd_decay_steps(config: TrainConfig) -> int:
    """warmup_stable_decay's decay: `decay_steps`, or a tenth of max_steps."""
    return config.decay_steps or max(1, config.max_steps // 10)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain dict of a config, with tuples as lists so that it round-trips through YAML."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def config_to_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def layout_to_yaml(layout: LayoutSettings) -> str:
    return yaml.safe_dump(layout_to_dict(layout), sort_keys=False)

"""Typed training configuration and how it is resolved.

A run's configuration is one dataclass: `TrainConfig` for the framework's fields, extended by each recipe
with its own fields and defaults. It is resolved in one fixed order, lowest precedence first:

    field defaults < the recipe's Config defaults < `--config file.yaml` < `key=value` overrides

Unknown keys are errors with a close-match hint and values are checked against the field's type, so a typo
never passes silently (the nanoGPT lesson). Each field carries a one-line docstring written under it; those
docstrings are read from the source and become `--help`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError


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
    micro_batch_size: int = 32
    """Samples per process per forward pass; accumulation steps are derived from it and the process count."""
    lr: float = 1e-3
    """Peak learning rate (before the optional scaling rule)."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup: cosine or linear down to min_lr_ratio * lr, or constant."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine or linear decay, as a fraction of the peak."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr by global_batch_size / reference_batch_size (linear) or its square root (sqrt)."""
    reference_batch_size: int = 0
    """Global batch size at which lr was tuned; required when lr_scaling is not none."""
    weight_decay: float = 0.0
    """AdamW weight decay, applied to matrices and embeddings but not to biases and norm gains."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    log_every_steps: int = 10
    """Log training metrics every this many optimizer steps (0: only the last step)."""
    eval_every_steps: int = 0
    """Evaluate every this many optimizer steps; 0 evaluates only at the end."""
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
    """Write checkpoints in a background thread from a snapshot in host memory (not under FSDP)."""
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None
    """Autocast precision; None takes the launcher's setting (the accelerate config), which defaults to no."""
    num_dataloader_workers: int = 0
    """Worker processes per data loader; 0 loads batches in the training process."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for a peer before the run fails instead of hanging."""
    show_progress_bar: bool = True
    """Show a tqdm progress bar on the main process."""
    activation_checkpointing: bool = False
    """Recompute each wrap_classes block's activations in backward: less memory, about a third more compute."""
    sync_batchnorm: bool = False
    """Normalise BatchNorm with the statistics of all processes' micro-batches (SyncBatchNorm; CUDA only)."""
    fp16_init_scale: float = 65536.0
    """Initial loss scale of the fp16 gradient scaler."""
    fp16_growth_interval: int = 2000
    """Optimizer steps without inf/NaN gradients before the fp16 loss scale doubles."""
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


def config_fields(config_cls: type) -> dict[str, Any]:
    """Map each field name of a config dataclass to its resolved type."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def field_docs(config_cls: type) -> dict[str, str]:
    """Read the docstring written under each field, walking the class and its bases.

    Attribute docstrings are not kept by Python at run time, so they are read from the source. Where there is
    none (a class defined in a notebook cell may have none), `field(..., metadata={"doc": "..."})` documents a
    field; it also wins over a docstring.
    """
    docs: dict[str, str] = {}
    for klass in reversed(config_cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        statements = body.body
        for stmt, nxt in zip(statements, statements[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    if dataclasses.is_dataclass(config_cls):
        for f in dataclasses.fields(config_cls):
            if "doc" in f.metadata:
                docs[f.name] = str(f.metadata["doc"])
    return docs


def describe_fields(config_cls: type) -> str:
    """The `--help` text: one line per field with its type, default and docstring."""
    docs = field_docs(config_cls)
    lines = []
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        type_name = _type_name(config_fields(config_cls)[f.name])
        lines.append(f"  {f.name}={default!r}  ({type_name})  {docs.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def coerce_value(name: str, value: Any, expected: Any) -> Any:
    """Return `value` converted to the field's type, or raise ConfigError naming the field and the type.

    Strings (from the command line) are parsed; typed values (from YAML or Python) are checked. An int is
    accepted for a float field, a bool never for a number.
    """
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce_value(name, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={value!r}: expected {_type_name(expected)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, args))}")
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise ConfigError(f"{name}={value!r}: expected a boolean (true or false)")
    if expected in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: expected {expected.__name__}, got a boolean")
        if isinstance(value, expected) or (expected is float and isinstance(value, int)):
            return expected(value)
        if isinstance(value, str):
            try:
                return expected(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r}: expected {expected.__name__}")
    if expected is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r}: expected a string")
    if origin in (tuple, list):
        items = [s for s in value.split(",") if s] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}={value!r}: expected a comma-separated list")
        item_type = args[0] if args else str
        return origin(coerce_value(name, item, item_type) for item in items)
    raise ConfigError(f"{name}: fields of type {_type_name(expected)} are not supported in configs")


def parse_overrides(arguments: list[str]) -> dict[str, str]:
    """Turn `key=value` command-line words into a dict, rejecting anything else with a usage hint."""
    overrides: dict[str, str] = {}
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep or not key:
            raise ConfigError(f"{argument!r} is not an override: write key=value, for example max_steps=100")
        overrides[key.strip()] = value
    return overrides


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of config values; a missing or malformed file is a one-line ConfigError."""
    path = Path(path)
    try:
        loaded = yaml.load(path.read_text(), Loader=_ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value lines")
    return loaded


def resolve_config(
    config_cls: type[TrainConfig],
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Build the run's config: class defaults, then the file, then overrides, each checked and typed."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_checked(config_cls, load_config_file(config_file), f"in {config_file}"))
    values.update(_checked(config_cls, dict(overrides or {}), "in overrides"))
    config = config_cls(**values)
    validate_config(config)
    return config


# The smallest value each framework field accepts, and whether the bound itself is allowed. A count below
# it would not fail later: max_steps=-5 trained nothing and exited 0.
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "max_steps": (1, True), "global_batch_size": (1, True), "micro_batch_size": (1, True),
    "warmup_steps": (0, True), "log_every_steps": (0, True), "eval_every_steps": (0, True),
    "save_every_steps": (0, True), "keep_last": (0, True), "num_dataloader_workers": (0, True),
    "reference_batch_size": (0, True), "lr": (0, True), "weight_decay": (0, True), "max_grad_norm": (0, True),
    "min_lr_ratio": (0, True), "collective_timeout_s": (0, False), "fp16_init_scale": (0, False),
    "fp16_growth_interval": (1, True), "ddp_bucket_cap_mb": (1, True), "ddp_powersgd_rank": (1, True),
}  # fmt: skip


def validate_config(config: TrainConfig) -> None:
    """Check the framework fields' ranges up front, so a bad value is a one-line error before any work.

    Raises:
        ConfigError: naming the field, its value and the range it must be in.
    """
    for name, (bound, inclusive) in _LOWER_BOUNDS.items():
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value}: expected a finite number")
        if value < bound or (value == bound and not inclusive):
            relation = "at least" if inclusive else "more than"
            raise ConfigError(f"{name}={value}: must be {relation} {bound}")
    if config.min_lr_ratio > 1:
        raise ConfigError(f"min_lr_ratio={config.min_lr_ratio}: must be at most 1 (a fraction of the peak lr)")


def config_warnings(config: TrainConfig) -> list[str]:
    """Values that are valid but probably not what was meant."""
    problems = []
    if config.warmup_steps > config.max_steps:
        problems.append(
            f"warmup_steps={config.warmup_steps} is beyond max_steps={config.max_steps}: the learning rate never"
            " reaches its peak"
        )
    return problems


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain dict of a config, with tuples as lists so that it round-trips through YAML."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def config_to_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def _checked(config_cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    fields = config_fields(config_cls)
    checked = {}
    for key, value in values.items():
        if not isinstance(key, str) or key not in fields:
            hint = difflib.get_close_matches(str(key), fields, n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {key!r} {where}{suggestion}")
        checked[key] = coerce_value(key, value, fields[key])
    return checked


def _type_name(expected: Any) -> str:
    if typing.get_origin(expected) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(expected))
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(expected))
    if expected is type(None):
        return "None"
    return getattr(expected, "__name__", str(expected))


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads only true/false as booleans (as YAML 1.2 does).

    YAML 1.1 also reads yes/no/on/off as booleans, so `mixed_precision: no` would arrive as False and be
    rejected; left as strings, bool fields still accept those words through `_BOOL_WORDS`.
    """


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

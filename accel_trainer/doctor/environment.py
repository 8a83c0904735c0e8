"""What `accel-trainer doctor` prints first: the environment a launch would run in (accelerate's `accelerate env`
facts, the packages accel-trainer uses, devices, CPUs and the variables that steer a launch)."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import sys
from argparse import Namespace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from accel_trainer.host import allocator

_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "ACCEL_TRAINER_FULL_TRACEBACK",
    "ACCEL_TRAINER_ALLOCATOR",
    "LD_PRELOAD",
)
_PREFIXES = ("NCCL_", "TORCH_NCCL_", "ACCELERATE_")
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def environment_report(path: Path) -> str:
    """accelerate's `accelerate env` facts, the packages accel-trainer uses, devices, CPUs and variables."""
    from accelerate.commands.env import env_command

    with contextlib.redirect_stdout(io.StringIO()):  # keep its facts, drop its "paste into your issue" text
        facts = {key.replace("`", ""): value for key, value in env_command(Namespace(config_file=str(path))).items()}
    versions = ", ".join(
        f"{name} {_version(name)}"
        for name in ("accel-trainer", "accelerate", "torch", "datasets", "transformers", "numpy")
    )
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices = f"{len(names)} CUDA device(s): {', '.join(names)} (CUDA {torch.version.cuda})"
    else:
        devices = f"no CUDA device (torch {torch.__version__}, accelerator: {facts.get('PyTorch accelerator')})"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    variables = {k: v for k, v in os.environ.items() if k in _VARIABLES or k.startswith(_PREFIXES)}
    lines = [
        "environment",
        f"  versions: Python {platform.python_version()}, {versions}",
        f"  platform: {facts.get('Platform')}; {_accelerate_command(facts.get('accelerate bash location'))}",
        f"  devices: {devices}; {os.cpu_count()} CPUs ({usable} usable), {facts.get('System RAM')} RAM",
        f"  host allocator: {allocator.for_the_command()}",
        "  variables: " + (" ".join(f"{k}={v}" for k, v in sorted(variables.items())) or "none of the launch ones set"),
        f"  layout {path}: " + _layout_summary(facts.get("Accelerate configs")),
    ]
    stray = [name for name in _LAUNCHER_VARIABLES if name in os.environ]
    if stray:
        lines.append(
            f"  note: {', '.join(stray)} set in this shell: a script started without a launcher will"
            " believe a launcher started it (launchers replace them for their workers)"
        )
    return "\n".join(lines)


def _layout_summary(config: Any) -> str:
    if not isinstance(config, dict):
        return str(config)
    shown = {
        key: value
        for key, value in config.items()
        if key == "use_cpu" or value not in (None, False, "", {}, []) and not key.startswith("tpu_")
    }
    return ", ".join(f"{key}={value.value if hasattr(value, 'value') else value}" for key, value in shown.items())


def _accelerate_command(location: Any) -> str:
    """Where `accelerate` is on PATH, and whether it is this Python's (the doctor launches with this Python)."""
    ours = Path(sys.executable).parent / "accelerate"
    if location == str(ours):
        return f"accelerate command: {location}"
    if location in (None, "Not found"):
        return f"no accelerate command on PATH (this Python's is {ours}; the checks below use it)"
    return (
        f"accelerate command on PATH: {location}, not this Python's ({ours}): `accelerate launch` may run"
        " another installation; the checks below use this Python's"
    )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"

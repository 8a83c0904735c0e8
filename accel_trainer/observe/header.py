"""What a run says about itself at start: a short header on the console, run_info.json and model_summary.txt.

The header tells in a few lines what will run where: recipe, layout (processes, strategy, precision), batch
plan, parameter count and run folder. `run_info.json` keeps what reproducing the run needs beyond its
config.yaml and layout.yaml: versions, git commit, command line, devices, layout, one entry per start (a
resumed run adds one). `model_summary.txt` is the recipe's model as torch prints it, with parameter counts.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from torch.distributed.tensor import DTensor

from accel_trainer.config.layout import LayoutSettings, layout_to_dict
from accel_trainer.contract.quantization import is_quantized, kept_in_full_precision, storage_bytes
from accel_trainer.data.batching import BatchPlan
from accel_trainer.host import allocator
from accel_trainer.parallel.mesh import data_ranks, describe_mesh
from accel_trainer.parallel.sharding import pipeline_size

_PACKAGES = ("accel-trainer", "torch", "accelerate", "datasets", "safetensors", "transformers")


def parameters_held(model: torch.nn.Module, accelerator: Accelerator) -> list[int]:
    """The parameter elements each process holds itself (its shard under FSDP or tensor parallelism), by rank.

    A collective on several processes: every process calls it.
    """
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return gather_object([held]) if accelerator.num_processes > 1 else [held]


def four_bit_base(model: torch.nn.Module, accelerator: Accelerator) -> str:
    """The header's line on a base held in 4 bits (QLoRA), empty without one: how many weights, the bytes one
    process holds of them (its shards under FSDP2, still 4-bit) against their size in the dtype they stand for, and
    the linear weights left as they were. A collective on several processes (each holds the same kind of model)."""
    quantized = [p for p in model.parameters() if is_quantized(p)]
    if not quantized:
        return ""
    held = sum(storage_bytes(p) for p in quantized)
    most = max(gather_object([held])) if accelerator.num_processes > 1 else held
    full = sum(p.numel() * p.element_size() for p in quantized)
    kept = kept_in_full_precision(accelerator.unwrap_model(model))
    kept_note = f"; {len(kept)} linear weight(s) not a multiple of 64 values kept as they were" if kept else ""
    dtype = str(quantized[0].dtype).removeprefix("torch.")
    return (
        f"  base: {len(quantized)} linear weights in 4 bits (NF4), {_size(most)} held by a process against"
        f" {_size(full)} in {dtype}{kept_note}"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.1f} KiB"


def header(
    accelerator: Accelerator,
    recipe_name: str,
    num_parameters: int,
    held: list[int],
    plan: BatchPlan,
    data_path: str,
    run_dir: Path,
    settings: str = "",
    frozen: int = 0,
    four_bits: str = "",
) -> str:
    """The start-of-run lines: what trains, on what, with which batches and data path, where it writes;
    `settings`: what the layout line says of its settings file (parallel/accelerator.py's settings_note);
    `frozen`: how many of the parameters do not train (a LoRA run's base); `four_bits`: `four_bit_base`'s line."""
    device = accelerator.device.type
    if device == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(accelerator.device)})"
    mesh = describe_mesh(accelerator)
    return "\n".join(
        [
            f"accel-trainer: recipe {recipe_name}, {num_parameters:,} parameters"
            f"{f', {num_parameters - frozen:,} of them trained' if frozen else ''}"
            f"{f' (at most {max(held):,} held by one process)' if max(held) < num_parameters else ''}",
            f"  layout: {accelerator.num_processes} process(es) on {device}, {_strategy(accelerator)}"
            f"{f' (mesh {mesh})' if mesh else ''}, precision {_precision(accelerator)}{settings}",
            f"  batch: {plan.global_batch_size} per step = {plan.micro_batch_size} per micro-batch x"
            f" {plan.num_processes} {'data-parallel rank(s)' if mesh else 'process(es)'} x {plan.accumulation_steps}"
            f" accumulation step(s){_fitted(plan)}",
            *([four_bits] if four_bits else []),
            f"  data: {data_path}",
            f"  run folder: {run_dir}",
        ]
    )


def _fitted(plan: BatchPlan) -> str:
    """What the batch line says when the recipe's default micro-batch size was lowered to fit (data/batching.py)."""
    if not plan.fitted_from:
        return ""
    return (
        f" (the recipe's micro-batch of {plan.fitted_from} does not split {plan.global_batch_size} over"
        f" {plan.num_processes} rank(s): {plan.micro_batch_size}, the largest below it that does;"
        " micro_batch_size= sets it)"
    )


def _precision(accelerator: Accelerator) -> str:
    return "fp32" if accelerator.mixed_precision == "no" else f"{accelerator.mixed_precision} mixed"


def _strategy(accelerator: Accelerator) -> str:
    """How the processes share the work, in the words the docs use (accelerate's names say MULTI_CPU, NO)."""
    pipeline = pipeline_size(accelerator) > 1
    if accelerator.distributed_type == DistributedType.FSDP:
        return "pipeline parallel x FSDP2" if pipeline else "FSDP2"
    if accelerator.num_processes == 1:
        return "single process"
    if pipeline:
        return "pipeline parallel"
    return "tensor parallel" if data_ranks(accelerator).size == 1 else "DDP"


def write_run_info(
    run_dir: Path, accelerator: Accelerator, layout: LayoutSettings, start_step: int, held: list[int], plan: BatchPlan
) -> None:
    """Append this start to `run_info.json` (main process), with the batches it trains: config.yaml keeps the
    micro-batch size as asked (`auto`, or the recipe's default that follows the layout), this the size taken."""
    path = run_dir / "run_info.json"
    try:
        starts = json.loads(path.read_text())["starts"] if path.is_file() else []
    except (ValueError, KeyError, TypeError):  # damaged: begin again rather than fail the run
        starts = []
    starts.append(
        {
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "start_step": start_step,
            "argv": sys.argv,
            "host": platform.node(),
            "python": platform.python_version(),
            "host_allocator": allocator.in_use(),
            "versions": {name: _version(name) for name in _PACKAGES},
            "git_commit": _git_commit(Path.cwd()),
            "devices": _devices(accelerator),
            "layout": {
                "distributed_type": accelerator.distributed_type.value,
                "num_processes": accelerator.num_processes,
                "mesh": describe_mesh(accelerator),
                "mixed_precision": accelerator.mixed_precision,
                **layout_to_dict(layout),
            },
            "parameters_held_per_process": held,
            "batch": {
                "global_batch_size": plan.global_batch_size,
                "micro_batch_size": plan.micro_batch_size,
                "data_parallel_ranks": plan.num_processes,
                "accumulation_steps": plan.accumulation_steps,
                "fitted_from": plan.fitted_from or None,
            },
        }
    )
    path.write_text(json.dumps({"starts": starts}, indent=1))


def model_summary(model: torch.nn.Module) -> str:
    """The model as torch prints it, with its parameter counts (taken before any wrapping or sharding)."""
    counts = [f"{name}: {sum(p.numel() for p in child.parameters()):,}" for name, child in model.named_children()]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{model}\n\nparameters: {total:,} ({trainable:,} trainable)\n" + "".join(f"  {c}\n" for c in counts)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(folder: Path) -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def _devices(accelerator: Accelerator) -> list[Any]:
    if accelerator.device.type == "cuda":
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [platform.processor() or platform.machine()]

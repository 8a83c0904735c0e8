"""Whether a model is spread over processes, and which of its state's tensors are one (tied weights).

Both decide how the model's state is written: a sharded model's checkpoint is a collective DCP save and its
full weights a collective gather; tied names are recorded, so that a restore and an export know them.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from accel_trainer.contract.quantization import is_quantized


def local_part(tensor: Any) -> Any:
    """This process's part of a DTensor (its shard or replica), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tied_names(model_state: dict[str, Any]) -> list[list[str]]:
    """Groups of state names that share one tensor (tied weights: an LM head and its embedding), recorded in
    each checkpoint, so that an export writes each name, as `final/model.safetensors` does."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, value in model_state.items():
        local = local_part(value)
        if isinstance(local, torch.Tensor) and local.numel() and not is_quantized(local):  # 4-bit: no one storage
            groups.setdefault((local.untyped_storage().data_ptr(), int(local.storage_offset())), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


def pipeline_size(accelerator: Accelerator) -> int:
    """The number of pipeline stages' processes (launch_fixes.attach_pipeline), 1 without a pipeline."""
    return getattr(accelerator.parallelism_config, "pp_size", 1)


def is_sharded(accelerator: Accelerator, model: torch.nn.Module) -> bool:
    """Whether the model's parameters are spread over processes, so that its checkpoints are sharded DCP saves
    and its full weights take a collective: FSDP2 (whose root parameters are plain tensors between a no-grad
    forward and the next backward, so the layout decides), tensor parallel (DTensors always) or a pipeline
    (each process holds its stages' weights)."""
    if accelerator.distributed_type == DistributedType.FSDP or pipeline_size(accelerator) > 1:
        return True
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def fsdp_root_initialized(model: Any) -> bool:
    """Initialise an FSDP2 root's state now, as its first forward would; whether `model` is one. Run before work
    that does not start at the root's forward: a rollout's `generate` (peft's runs the inner LM, so each sharded
    block took itself for a root: "FSDP requires a single root module") and estimate's count (FSDP pads uneven
    shards again at its first use). torch's private `_lazy_init`, called here alone; canaries: tests/test_grpo.py's
    cpu_fsdp run and tests/unit/estimate's FSDP plans."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return False
    state()._lazy_init()
    return True

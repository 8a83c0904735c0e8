"""What a launched process of a real layout holds through the estimate's two training steps, on real tensors:
counted directly from its parameters, gradients, optimizer state and DDP's buckets, and its peak as torch's
MemTracker sees the real steps (the estimate's own preparation, `step_memory.prepared`, run on real tensors and a
real process group). Writes <out>/rank<r>.json for test_estimate.py to set beside the estimate.

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml tests/workers/estimate_truth.py gpt OUT k=v ...
"""

import json
import os
import re
import sys
from pathlib import Path

import torch

from accel_trainer.config.train_config import resolve_settings
from accel_trainer.estimate import step_memory
from accel_trainer.parallel.accelerator import build_accelerator, launch_settings_file
from accel_trainer.parallel.sharding import local_part
from accel_trainer.registry import get_recipe


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages under `tensors` (a DTensor's local one, padded as FSDP pads it)."""
    storages = {}
    for tensor in tensors:
        storage = local_part(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def ddp_bucket_bytes(model) -> int:
    """DDP's gradient buckets as DDP reports them; 0 where the gradients are views into them."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(int(size) for size in re.findall(r"\d+", str(model._get_ddp_logging_data()["bucket_sizes"])))


def main() -> None:
    recipe_name, out, *words = sys.argv[1:]
    overrides = dict(word.split("=", 1) for word in words)
    recipe_cls = get_recipe(recipe_name)
    cfg, settings = resolve_settings(recipe_cls.Config, None, overrides, launch_settings_file())
    accelerator = build_accelerator(cfg, settings)
    recipe = recipe_cls(cfg)
    examples = step_memory.first_examples(recipe, cfg)
    rank = accelerator.process_index
    model, optimizer, step = step_memory.prepared(recipe, cfg, settings, accelerator, examples)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _, tracked_peak = step_memory.tracked_steps(model, optimizer, step)  # on real tensors: what the step allocates
    peak = sum(snapshot["Total"] for snapshot in tracked_peak.values())
    parameters = list(model.parameters())
    states = [v for o in optimizer.optimizers for state in o.state.values() for v in state.values()]
    held = {
        "params_bytes": storage_bytes(parameters),
        "grads_bytes": storage_bytes(p.grad for p in parameters if p.grad is not None) + ddp_bucket_bytes(model),
        "optimizer_bytes": storage_bytes(v for v in states if isinstance(v, torch.Tensor)),
        # DDP's buckets: built before the count, then built again in the second step's forward (DDP orders them
        # as the first backward readied the gradients), so the count holds them once
        "tracked_peak_bytes": peak,
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(held))
    accelerator.wait_for_everyone()
    os._exit(0)  # as the framework's workers end (training.py): a gloo group's teardown at exit may hang


if __name__ == "__main__":
    main()

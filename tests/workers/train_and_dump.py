"""Test worker: train a registered recipe, check the world size, dump this rank's parameters.

    ACCEL_TEST_DUMP_DIR=out ACCEL_TEST_EXPECTED_WORLD_SIZE=2 \
        accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/train_and_dump.py vae k=v

Writes `out/rank<r>.safetensors` with the parameters this rank holds at the end (none under FSDP, whose
consolidated weights are the run's final/model.safetensors), so a test can compare ranks with each other,
and `out/rank<r>.json` with the number of parameter elements the rank holds itself (half of them per rank
under 2-process FSDP) and trains (its stages' under a pipeline), the step counts in the optimizer's own
state (one step per accumulation window, never more), the DDP communication hooks registered and the names
of the parameters and buffers the rank holds as shards (DTensors); `out/rank<r>.buffers.safetensors` holds
the rank's buffers (its local part of a sharded one).
ACCEL_TEST_RECIPE_FOLDER names a folder of extra recipes to register; ACCEL_TEST_CUDA_MEMORY_FRACTION caps
the GPU memory this process may use. Exits 3 if this process sees a
different world size than the test expected.
"""

import json
import os
import sys
from pathlib import Path

from accelerate.state import PartialState
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import accel_trainer as at

if os.environ.get("ACCEL_TEST_CUDA_MEMORY_FRACTION"):  # a smaller GPU, to run out of memory on purpose
    import torch

    torch.cuda.set_per_process_memory_fraction(float(os.environ["ACCEL_TEST_CUDA_MEMORY_FRACTION"]))
if os.environ.get("ACCEL_TEST_RECIPE_FOLDER"):  # extra test recipes, e.g. deliberately wrong variants
    at.registry.discover_recipes([Path(os.environ["ACCEL_TEST_RECIPE_FOLDER"])])
recipe_name, overrides = sys.argv[1], sys.argv[2:]
recipe_cls = at.get_recipe(recipe_name)
built_models, built_optimizers = [], []
build_model, build_optimizer = recipe_cls.build_model, recipe_cls.build_optimizer


def recording_build_model(self, cfg):
    model = build_model(self, cfg)
    built_models.append(model)
    return model


def recording_build_optimizer(self, cfg, model):
    optimizer = build_optimizer(self, cfg, model)
    built_optimizers.append(optimizer)
    return optimizer


comm_hooks = []
register_comm_hook = DistributedDataParallel.register_comm_hook


def recording_register_comm_hook(self, state, hook):
    rank = getattr(state, "matrix_approximation_rank", None)
    comm_hooks.append(hook.__name__ if rank is None else f"{hook.__name__} rank {rank}")
    return register_comm_hook(self, state, hook)


DistributedDataParallel.register_comm_hook = recording_register_comm_hook
recipe_cls.build_model = recording_build_model
recipe_cls.build_optimizer = recording_build_optimizer
result = at.train(recipe_name, **at.typed_fields.parse_overrides(overrides))
state = PartialState()
expected = int(os.environ["ACCEL_TEST_EXPECTED_WORLD_SIZE"])
if state.num_processes != expected:
    print(f"rank {state.process_index} sees a world of {state.num_processes}, expected {expected}", file=sys.stderr)
    os._exit(3)
trained = built_models[0]  # the first model built is the one trained; later ones are exports
parameters, local_elements = {}, 0
for name, parameter in trained.named_parameters():
    if isinstance(parameter.data, DTensor):  # an FSDP2 shard: count what this rank holds
        local_elements += parameter.data.to_local().numel()
    else:
        local_elements += parameter.numel()
        parameters[name.replace("_checkpoint_wrapped_module.", "")] = parameter.detach().contiguous()
built = built_optimizers[0]
optimizers = list(built.values()) if isinstance(built, dict) else [built]  # several by name, or one
optimizer_steps = {int(s["step"]) for o in optimizers for s in o.state.values()}  # AdamW's own count
optimizer_elements = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()  # what this rank trains
                         for o in optimizers for group in o.param_groups for p in group["params"])  # fmt: skip
buffers = {}  # cloned: two names of one tensor (a shared mask) are two tensors in safetensors
for name, buffer in trained.named_buffers():
    if not buffer.is_meta:
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        buffers[name.replace("_checkpoint_wrapped_module.", "")] = local.detach().clone()
out = Path(os.environ["ACCEL_TEST_DUMP_DIR"])
save_file(parameters, str(out / f"rank{state.process_index}.safetensors"))
save_file(buffers, str(out / f"rank{state.process_index}.buffers.safetensors"))
sharded_parameters = sorted(name for name, p in trained.named_parameters() if isinstance(p.data, DTensor))
sharded_buffers = sorted(name for name, b in trained.named_buffers() if isinstance(b, DTensor))
summary = {"local_elements": local_elements, "optimizer_elements": optimizer_elements,
           "optimizer_steps": sorted(optimizer_steps), "comm_hooks": comm_hooks,
           "sharded_parameters": sharded_parameters, "sharded_buffers": sharded_buffers}  # fmt: skip
(out / f"rank{state.process_index}.json").write_text(json.dumps(summary))
sys.stdout.flush()
os._exit(0)

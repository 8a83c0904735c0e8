"""Test worker: train a registered recipe, check the world size, dump this rank's parameters.

    ACCEL_TEST_DUMP_DIR=out ACCEL_TEST_EXPECTED_WORLD_SIZE=2 \
        accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/train_and_dump.py vae k=v

Writes `out/rank<r>.safetensors` with the parameters this rank holds at the end (none under FSDP, whose
consolidated weights are the run's final/model.safetensors), so a test can compare ranks with each other,
and `out/rank<r>.json` with the number of parameter elements the rank holds itself (half of them per rank
under 2-process FSDP) and trains (its stages' under a pipeline), the step counts in the optimizer's own
state (one step per accumulation window, never more), the DDP communication hooks registered and the names
of the parameters and buffers the rank holds as shards (DTensors); `out/rank<r>.buffers.safetensors` holds
the rank's buffers (its local part of a sharded one); `four_bit_bytes` the bytes of each 4-bit weight (QLoRA) the
rank holds, which are not in its safetensors.
ACCEL_TEST_RECIPE_FOLDER names a folder of extra recipes to register; ACCEL_TEST_CUDA_MEMORY_FRACTION caps
the GPU memory this process may use. Exits 3 if this process sees a
different world size than the test expected.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/train_and_dump.py --serve DIR

serves many such runs in one launch (tests/conftest.py's `train_and_dump`): every process trains the scenario
of `DIR/request_<n>.json` ({recipe, overrides, out, world_size}) with `at.train(keep_process_group=True)`, in
the order n = 0, 1, ..., writes the same files as above and then `DIR/done_<n>_rank<r>`. A failed scenario
writes its error there and ends the launch; the test suite starts a fresh one for the next request. Starting
torch, accelerate and the process group once per layout instead of once per scenario is most of what a
launch costs on 2 cores; tests/layouts/test_scenario_launches.py proves that a scenario trained second in a launch is
bitwise the same as in a fresh launch.
"""

import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from accelerate.state import PartialState
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import accel_trainer as at
from accel_trainer.config.fields import parse_overrides
from accel_trainer.contract.quantization import is_quantized, storage_bytes

comm_hooks: list[str] = []
register_comm_hook = DistributedDataParallel.register_comm_hook


def recording_register_comm_hook(self, state, hook):
    rank = getattr(state, "matrix_approximation_rank", None)
    comm_hooks.append(hook.__name__ if rank is None else f"{hook.__name__} rank {rank}")
    return register_comm_hook(self, state, hook)


def world() -> tuple[int, int]:
    """(rank, world size) as this process sees them: its kept process group, or accelerate's last state."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = PartialState()
    return state.process_index, state.num_processes


def train_and_dump(recipe_name: str, overrides: list[str], out: Path, expected_world_size: int, keep_group: bool):
    """Train one scenario, recording what the recipe built, and dump this rank's state into `out`."""
    recipe_cls = at.get_recipe(recipe_name)
    built_models, built_optimizers = [], []
    build_model, build_optimizer = recipe_cls.build_model, recipe_cls.build_optimizer

    def recording_build_model(self, cfg):
        model = build_model(self, cfg)
        built_models.append(model)
        return model

    @functools.wraps(build_optimizer)  # the recipe's own or the default, as the run tells them apart
    def recording_build_optimizer(self, cfg, model):
        optimizer = build_optimizer(self, cfg, model)
        built_optimizers.append(optimizer)
        return optimizer

    comm_hooks.clear()
    recipe_cls.build_model, recipe_cls.build_optimizer = recording_build_model, recording_build_optimizer
    try:
        at.train(recipe_name, keep_process_group=keep_group, **parse_overrides(overrides))
    finally:
        recipe_cls.build_model, recipe_cls.build_optimizer = build_model, build_optimizer
    rank, world_size = world()
    if world_size != expected_world_size:
        print(f"rank {rank} sees a world of {world_size}, expected {expected_world_size}", file=sys.stderr)
        os._exit(3)
    dump(built_models[0], built_optimizers[0], out, rank)  # the first model built is the one trained


def dump(trained, built, out: Path, rank: int) -> None:
    parameters, local_elements, four_bits = {}, 0, {}
    for name, parameter in trained.named_parameters():
        if is_quantized(parameter):  # a 4-bit weight (QLoRA): what it holds, not its values
            four_bits[name.replace("_checkpoint_wrapped_module.", "")] = storage_bytes(parameter)
        if isinstance(parameter.data, DTensor):  # an FSDP2 shard: count what this rank holds
            local_elements += parameter.data.to_local().numel()
        else:
            local_elements += parameter.numel()
            if not is_quantized(parameter):
                parameters[name.replace("_checkpoint_wrapped_module.", "")] = parameter.detach().contiguous()
    optimizers = list(built.values()) if isinstance(built, dict) else [built]  # several by name, or one
    optimizer_steps = {int(s["step"]) for o in optimizers for s in o.state.values() if "step" in s}  # AdamW's count
    optimizer_elements = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel()  # what this rank trains
        for o in optimizers
        for group in o.param_groups
        for p in group["params"]
    )
    buffers = {}  # cloned: two names of one tensor (a shared mask) are two tensors in safetensors
    for name, buffer in trained.named_buffers():
        if not buffer.is_meta:
            local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
            buffers[name.replace("_checkpoint_wrapped_module.", "")] = local.detach().clone()
    save_file(parameters, str(out / f"rank{rank}.safetensors"))
    save_file(buffers, str(out / f"rank{rank}.buffers.safetensors"))
    summary = {
        "local_elements": local_elements,
        "optimizer_elements": optimizer_elements,
        "optimizer_steps": sorted(optimizer_steps),
        "comm_hooks": list(comm_hooks),
        "sharded_parameters": sorted(n for n, p in trained.named_parameters() if isinstance(p.data, DTensor)),
        "sharded_buffers": sorted(n for n, b in trained.named_buffers() if isinstance(b, DTensor)),
        "four_bit_bytes": four_bits,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(summary))


def serve(folder: Path) -> None:
    """Train the scenarios requested in `folder`, one after another, until the test suite ends the launch."""
    launcher = os.getppid()
    (folder / f"pid_rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))  # for the suite to end it
    for number in range(sys.maxsize):
        request_file = folder / f"request_{number}.json"
        while not request_file.exists():
            if os.getppid() != launcher:  # the launcher is gone (the suite ended it): nothing more will come
                os._exit(0)
            time.sleep(0.02)
        request = json.loads(request_file.read_text())
        try:
            if "torch._dynamo" in sys.modules:  # compiled code of the last scenario is not reused
                torch._dynamo.reset()
            train_and_dump(request["recipe"], request["overrides"], Path(request["out"]), request["world_size"], True)
            outcome = "ok"
        except at.UserError as refusal:  # said by every process alike: the launch serves on (LayoutLaunches.train)
            outcome = f"refused: {refusal}"
        except BaseException:
            outcome = traceback.format_exc()
        rank = world()[0] if outcome == "ok" else int(os.environ.get("RANK", "0"))
        done = folder / f"done_{number}_rank{rank}"
        done.with_suffix(".tmp").write_text(outcome)
        done.with_suffix(".tmp").replace(done)
        sys.stdout.flush()
        sys.stderr.flush()
        if outcome != "ok" and not outcome.startswith("refused: "):
            os._exit(1)


if os.environ.get("ACCEL_TEST_CUDA_MEMORY_FRACTION"):  # a smaller GPU, to run out of memory on purpose
    torch.cuda.set_per_process_memory_fraction(float(os.environ["ACCEL_TEST_CUDA_MEMORY_FRACTION"]))
if os.environ.get("ACCEL_TEST_RECIPE_FOLDER"):  # extra test recipes, e.g. deliberately wrong variants
    at.registry.discover_recipes([Path(os.environ["ACCEL_TEST_RECIPE_FOLDER"])])
DistributedDataParallel.register_comm_hook = recording_register_comm_hook
if sys.argv[1] == "--serve":
    serve(Path(sys.argv[2]))
else:
    out = Path(os.environ["ACCEL_TEST_DUMP_DIR"])
    train_and_dump(sys.argv[1], sys.argv[2:], out, int(os.environ["ACCEL_TEST_EXPECTED_WORLD_SIZE"]), False)
sys.stdout.flush()
os._exit(0)

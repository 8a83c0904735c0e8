"""Test worker: train a registered recipe, check the world size, dump this rank's parameters.

    ACCEL_TEST_DUMP_DIR=out ACCEL_TEST_EXPECTED_WORLD_SIZE=2 \
        accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/train_and_dump.py vae k=v

Writes `out/rank<r>.safetensors` with the parameters each process holds at the end, so a test can compare
ranks with each other and with other layouts. Exits 3 if this process sees a different world size than the
test expected.
"""

import os
import sys
from pathlib import Path

from accelerate.state import PartialState
from safetensors.torch import save_file

import accel_trainer as at

recipe_name, overrides = sys.argv[1], sys.argv[2:]
recipe_cls = at.get_recipe(recipe_name)
built_models = []
build_model = recipe_cls.build_model


def recording_build_model(self, cfg):
    model = build_model(self, cfg)
    built_models.append(model)
    return model


recipe_cls.build_model = recording_build_model
result = at.train(recipe_name, **at.config.parse_overrides(overrides))
state = PartialState()
expected = int(os.environ["ACCEL_TEST_EXPECTED_WORLD_SIZE"])
if state.num_processes != expected:
    print(f"rank {state.process_index} sees a world of {state.num_processes}, expected {expected}", file=sys.stderr)
    os._exit(3)
trained = built_models[0]  # the first model built is the one trained; later ones are exports
parameters = {name: p.detach().contiguous() for name, p in trained.named_parameters()}
save_file(parameters, str(Path(os.environ["ACCEL_TEST_DUMP_DIR"]) / f"rank{state.process_index}.safetensors"))
sys.stdout.flush()
os._exit(0)

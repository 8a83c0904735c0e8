"""Test worker for the signal tests: `at.main` on a test recipe, saying its pid, with saves slowed on request.

    ACCEL_TEST_MARKERS=dir ACCEL_TEST_SLOW_STEP_S=0.2 \
        accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/signalled_run.py mlp_slow k=v

Writes `dir/pid.rank<r>` (this process's pid) before training, so a test can signal every worker itself, as a
scheduler does. ACCEL_TEST_SLOW_SAVE_S: each checkpoint save first writes `dir/save.rank<r>` and sleeps this
long (inside the save: the loop is in "the save of step N"). The recipes' own delays: recipes/slow_phases.py.
With `--notebook N` it calls `at.train(recipe, num_processes=N)` instead, as a script or notebook does, and
prints what it returned or raised (`caller got Preempted: ...`), exiting 75 on Preempted.
"""

import os
import sys
import time
from pathlib import Path

import accel_trainer as at
from accel_trainer.checkpoint import save as checkpoint
from accel_trainer.config.fields import parse_overrides
from accel_trainer.stopping.signals import EXIT_PREEMPTED, Preempted

sys.path.insert(0, str(Path(__file__).resolve().parent / "recipes"))
from slow_phases import mark  # noqa: E402 - after the recipes folder is on the path

at.registry.discover_recipes([Path(__file__).resolve().parent / "recipes"])
slow_save_s = float(os.environ.get("ACCEL_TEST_SLOW_SAVE_S", "0"))
if slow_save_s:
    save = checkpoint.save

    def slow_save(*args, **kwargs):
        mark("save")
        time.sleep(slow_save_s)
        return save(*args, **kwargs)

    checkpoint.save = slow_save
if os.environ.get("ACCEL_TEST_MARKERS"):
    marker = Path(os.environ["ACCEL_TEST_MARKERS"], f"pid.rank{os.environ.get('RANK', '0')}")
    partial = marker.with_name(marker.name + ".partial")
    partial.write_text(str(os.getpid()))
    partial.rename(marker)  # whole or absent: the test reads it the moment it appears

if sys.argv[1] == "--notebook":
    num_processes, recipe = int(sys.argv[2]), sys.argv[3]
    overrides = parse_overrides(sys.argv[4:])
    try:
        print(f"caller got {at.train(recipe, num_processes=num_processes, **overrides)}", flush=True)
    except Preempted as stop:
        print(f"caller got Preempted: {stop}", flush=True)
        print(f"with the launcher's error chained: {stop.__cause__ is not None}", flush=True)
        sys.exit(EXIT_PREEMPTED)
else:
    at.main(sys.argv[1], sys.argv[2:])

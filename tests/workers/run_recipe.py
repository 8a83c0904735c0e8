"""Test worker: run a recipe through the command-line entry (one-line errors, exit statuses), test recipes included.

accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/run_recipe.py vae_hang k=v
"""

import sys
from pathlib import Path

import accel_trainer as at

at.registry.discover_recipes([Path(__file__).resolve().parent / "recipes"])
at.main(sys.argv[1], sys.argv[2:])

"""`python -m accel_trainer` (and `accelerate launch -m accel_trainer`) is the `accel-trainer` command."""

from accel_trainer.cli import main

main()

"""`python -m accel_trainer` (and `accelerate launch -m accel_trainer`) is the `accel-trainer` command."""

from .cli import main

main()

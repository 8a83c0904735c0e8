"""Test worker: print the world size a bare `Accelerator()` sees (no accel-trainer fixes)."""

from accelerate import Accelerator

print("world", Accelerator().num_processes, flush=True)

"""Test worker: report what a bare `Accelerator()` sees (no accel-trainer fixes), in one write per process.

bare_accelerator_world.py [--cpu]      prints "world <N> <distributed type>"
"""

import os
import sys

from accelerate import Accelerator

accelerator = Accelerator(cpu="--cpu" in sys.argv)
# One os.write, so that two processes' lines never interleave (print writes its pieces separately when
# PYTHONUNBUFFERED is set).
os.write(1, f"world {accelerator.num_processes} {accelerator.distributed_type.value}\n".encode())

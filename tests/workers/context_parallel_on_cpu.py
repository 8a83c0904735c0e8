"""Test worker: train_and_dump.py with context parallelism let through on the CPU.

torch has no CPU kernel for ring attention, so accel-trainer refuses cp_size > 1 on the CPU (parallel/mesh.py). A model
without attention (the GPT with n_layer=0: embeddings, final norm, tied head) needs no such kernel, and on it
everything else context parallelism does can run on the CPU: the mesh, the sequence slices of the batch, the
loss sums over slices, the item counts and FSDP's averaging over dp x cp. Arguments as train_and_dump.py's.
"""

import runpy
import sys
from pathlib import Path

from accel_trainer.parallel import mesh

mesh.CONTEXT_PARALLEL_DEVICES = {"cuda", "cpu"}
sys.argv[0] = str(Path(__file__).with_name("train_and_dump.py"))
runpy.run_path(sys.argv[0], run_name="__main__")

"""The process's heap while a run trains: Python's cyclic garbage collector kept off the objects a run builds
before it trains, and glibc's allocator made to give large blocks back.

A full (generation 2) collection scans every object the process holds: after importing torch, accelerate and
datasets and building the run, about 424,000 of them, 0.2 s a pass on the 2-core CPU box. Python runs one
whenever enough new objects have survived, which a checkpoint's planning brings about: a 2-process FSDP run of
a 2,410-parameter MLP stalled 0.23 s in the step after its third background save (the writer's thread held the
GIL for the collection; events.jsonl saw nothing), and a synchronous save took 0.24 s instead of 0.03 s.
`gc.freeze()` moves the objects alive when training starts into a generation no collection scans; the
collections during training then see only what training makes. `gc.unfreeze()` at the end hands them back, so
that a notebook's next run collects this one's cycles.

glibc's malloc serves a block below its mmap threshold from its heap, and raises that threshold to the size of
each mapped block freed, up to 32 MiB: after the first step a CPU run's activations (1 to 30 MiB tensors, made and
freed each micro-batch) all come from the heap, whose freed pieces are kept, fragmented, and rarely given back.
SmolLM2-135M's sft_chat (LoRA, 8 windows of 129 tokens a micro-batch, 2 accumulated) held 2.4 GiB of live tensors
at its peak and 6.4 GiB of resident memory, growing over its first three steps. `large_blocks_returned` fixes the
threshold at 1 MiB (`mallopt(M_MMAP_THRESHOLD)`, as the environment variable MALLOC_MMAP_THRESHOLD_=1048576
would): a block of 1 MiB or more is mapped when made and unmapped when freed, and the same run peaks at 2.7 GiB
(benchmarks/sft_vs_trl.py; docs/memory.md). The price is the kernel's zeroing of the pages each new block touches.
A threshold the user set (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES) is kept; elsewhere than glibc, nothing to do,
and nothing either where the `accel-trainer` command runs on tcmalloc or jemalloc (host/allocator.py), which reuse
freed blocks by size without either cost.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from collections.abc import Iterator

from accel_trainer.host import allocator

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc's malloc.h)."""
LARGE_BLOCK_BYTES = 1 << 20
"""Blocks of this size and more are mapped and given back when freed (`large_blocks_returned`)."""


@contextlib.contextmanager
def setup_left_out_of_collections() -> Iterator[None]:
    """While training: the objects alive at its start are not scanned by the garbage collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def large_blocks_returned() -> bool:
    """On glibc, blocks of LARGE_BLOCK_BYTES and more mapped when made and given back to the system when freed,
    from now on in this process (see the module's docstring); whether the threshold was set here. A threshold the
    user chose in the environment is kept."""
    chosen = "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
    if chosen or not sys.platform.startswith("linux") or allocator.in_use() != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))
    except (OSError, AttributeError):  # not glibc (musl): its allocator has no such threshold
        return False

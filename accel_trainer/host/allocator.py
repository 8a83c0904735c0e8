"""The C allocator a process of the `accel-trainer` command runs on: tcmalloc (or jemalloc) where the system has
one, as torch's own CPU launcher (`python -m torch.backends.xeon.run_cpu --enable-tcmalloc`) arranges.

A CPU training step makes and frees its activations, blocks of a few MiB, every micro-batch. glibc's malloc
either keeps them in its heap, which fragments (SmolLM2-135M's sft_chat, LoRA, 8 windows of 128 tokens a
micro-batch: 6.1 GiB resident for 2.4 GiB of live tensors), or, with engine/heap.py's 1 MiB mmap threshold, maps
and unmaps each one, and the kernel's zeroing of every fresh page made the same step 1.6 times slower. tcmalloc
and jemalloc keep freed blocks by size and reuse them; on that run (5 steps, 2 cores, float32):

    glibc, its own threshold      7.1 s a step   6,112 MiB peak
    glibc, 1 MiB threshold       11.5 s          2,760 MiB
    jemalloc                      7.3 s          2,543 MiB
    tcmalloc                      6.6 s          2,507 MiB

An allocator has to be in the process before its first allocation, so `accel-trainer train|evaluate|sample`
replaces itself (`os.execv`: the same process id, so terminals, launchers and signals see no difference) with
the same command under LD_PRELOAD naming the library; the processes it launches inherit it. It is found the way
the dynamic linker finds libraries (`ctypes.util.find_library`: Debian's libtcmalloc-minimal4, libjemalloc2) or
in the active conda environment or virtualenv (conda-forge's gperftools or jemalloc). `ACCEL_TRAINER_ALLOCATOR`
chooses: `auto` (the default: tcmalloc, else jemalloc, else glibc), `tcmalloc`, `jemalloc` or `glibc`. Not on
`at.train` in a running interpreter, which keeps the allocator it started with (engine/heap.py then maps large
blocks). run_info.json records the allocator each start ran on (`host_allocator`).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import glob
import os
import sys
from pathlib import Path

from accel_trainer.errors import UserError

CHOICE_VARIABLE = "ACCEL_TRAINER_ALLOCATOR"
LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
"""Each allocator's library names (libNAME.so), the lighter one first: tcmalloc_minimal lacks only the heap
profiler."""
QUIET = {
    "tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)},  # else a line for each block over 1 GiB
    "jemalloc": {"MALLOC_CONF": "oversize_threshold:1,background_thread:true,metadata_thp:auto"},  # torch's run_cpu's
}
"""Each allocator's settings where the environment has none: quiet, and jemalloc as torch's launcher sets it."""
TRIED = "ACCEL_TRAINER_ALLOCATOR_TRIED"
"""Set in the replaced process, so that a library the linker refused to preload is not tried again."""


@functools.cache
def in_use() -> str:
    """The allocator this process runs on: "tcmalloc" or "jemalloc" where one is loaded, else "glibc" (the C
    library's own, on Linux, and whatever other systems have). An allocator cannot change in a running process,
    so the answer is read once."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    return next((name for name in LIBRARIES if f"lib{name}" in maps), "glibc")


def release_free_memory() -> None:
    """Give the memory the allocator keeps for reuse back to the system: glibc's `malloc_trim(0)`, tcmalloc's
    `MallocExtension_ReleaseFreeMemory()`, jemalloc's purge of every arena (`arena.<MALLCTL_ARENAS_ALL>.purge`).

    For a phase whose freed blocks the next one cannot reuse: quantizing a base to 4 bits frees each weight's
    full-precision values and the quantizer's temporaries (over 64 bytes a value), sizes training never asks for
    again. On tcmalloc, releasing them as each weight is quantized lowered a QLoRA run's peak while it loaded
    (SmolLM2-135M from a folder: 828-905 MiB, three runs, to 789 MiB; from its GGUF file: 1,014 to 971 MiB)."""
    with contextlib.suppress(AttributeError, OSError, TypeError):  # no such function or library in this process
        process = ctypes.CDLL(None)
        if in_use() == "tcmalloc":
            process.MallocExtension_ReleaseFreeMemory()
        elif in_use() == "jemalloc":
            process.mallctl(b"arena.4096.purge", None, None, None, 0)
        else:
            process.malloc_trim(0)


def installed(name: str) -> str | None:
    """The path (or linker name) of the allocator `name`'s library on this system, or None."""
    prefixes = {os.environ.get("CONDA_PREFIX"), os.environ.get("VIRTUAL_ENV"), sys.prefix} - {None}
    for library in LIBRARIES[name]:
        for prefix in sorted(str(p) for p in prefixes):
            found = sorted(glob.glob(f"{prefix}/lib/lib{library}.so*"))
            if found:
                return found[0]
        found_by_linker = ctypes.util.find_library(library)
        if found_by_linker:
            return found_by_linker
    return None


def chosen() -> str:
    """ACCEL_TRAINER_ALLOCATOR, checked: auto (unset), tcmalloc, jemalloc or glibc."""
    choice = os.environ.get(CHOICE_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in ("auto", "glibc", *LIBRARIES):
        raise UserError(f"{CHOICE_VARIABLE}={choice} is not an allocator: use auto, tcmalloc, jemalloc or glibc")
    return choice


def preload_environment(environment: dict[str, str]) -> dict[str, str] | None:
    """`environment` with the chosen allocator preloaded (and its noise off), or None where nothing is to be
    preloaded: glibc chosen, one already loaded or preloaded, none installed, or not Linux. An allocator asked
    for by name that is not installed is a UserError naming the package that has it."""
    choice = chosen()
    preloaded = environment.get("LD_PRELOAD", "")
    if choice == "glibc" or not sys.platform.startswith("linux") or in_use() != "glibc":
        return None
    if any(f"lib{library}" in preloaded for names in LIBRARIES.values() for library in names):
        return None
    found = first_installed(choice)
    if found is None:
        if choice == "auto":
            return None
        package = "libtcmalloc-minimal4 (or conda's gperftools)" if choice == "tcmalloc" else "libjemalloc2"
        raise UserError(f"{CHOICE_VARIABLE}={choice}: its library is not installed; install {package}, or unset it")
    name, path = found
    quiet = {key: value for key, value in QUIET[name].items() if key not in environment}
    return {**environment, **quiet, "LD_PRELOAD": ":".join(filter(None, [path, preloaded])), TRIED: name}


def first_installed(choice: str) -> tuple[str, str] | None:
    """The allocator `choice` names (auto: tcmalloc, else jemalloc) and its library, where installed."""
    names = list(LIBRARIES) if choice == "auto" else [choice]
    return next(((name, path) for name in names if (path := installed(name))), None)


def for_the_command() -> str:
    """What `accel-trainer train` runs on here, in a few words (for `accel-trainer doctor`)."""
    try:
        choice = chosen()
    except UserError as error:
        return str(error)
    if choice == "glibc":
        return f"glibc ({CHOICE_VARIABLE}=glibc)"
    found = first_installed(choice)
    if found is not None:
        return f"{found[0]} ({found[1]})"
    return (
        "glibc (no tcmalloc or jemalloc installed: libtcmalloc-minimal4 or conda's gperftools makes CPU steps faster"
        " in less memory)"
    )


def run_under_fast_allocator() -> None:
    """Replace this process with the same command under tcmalloc or jemalloc where one is installed (see the
    module's docstring); returns where nothing is to change. Call it first thing, before torch is imported."""
    if os.environ.get(TRIED):
        return
    environment = preload_environment(dict(os.environ))
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)

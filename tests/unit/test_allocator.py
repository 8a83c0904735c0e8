"""The `accel-trainer` command trains on tcmalloc (or jemalloc) where the system has one: glibc's heap kept a CPU
run's freed activation blocks fragmented (6.1 GiB for 2.4 GiB of live tensors), and mapping each one instead
made steps 1.6 times slower (accel_trainer/host/allocator.py). The command replaces itself with the same command under
LD_PRELOAD; its launched processes inherit it; ACCEL_TRAINER_ALLOCATOR chooses; run_info.json records it."""

import json
import os
import subprocess
import sys

import pytest

from accel_trainer.engine import heap
from accel_trainer.errors import UserError
from accel_trainer.host import allocator


@pytest.fixture
def clean_environment(monkeypatch):
    for name in (allocator.CHOICE_VARIABLE, allocator.TRIED, "LD_PRELOAD", "MALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "in_use", lambda: "glibc")


def test_the_first_installed_allocator_is_preloaded_ahead_of_the_users_preloads_and_made_quiet(
    clean_environment, monkeypatch
):
    monkeypatch.setattr(allocator, "installed", lambda name: f"/opt/lib{name}.so" if name == "jemalloc" else None)
    environment = allocator.preload_environment({"LD_PRELOAD": "/opt/libmine.so", "MALLOC_CONF": "narenas:1"})

    assert environment is not None
    assert environment["LD_PRELOAD"] == "/opt/libjemalloc.so:/opt/libmine.so"
    assert environment["MALLOC_CONF"] == "narenas:1"  # the user's settings of it are kept
    assert environment[allocator.TRIED] == "jemalloc"  # the replaced process does not try again

    monkeypatch.setattr(allocator, "installed", lambda name: f"/opt/lib{name}.so")
    tcmalloc = allocator.preload_environment({})
    assert tcmalloc is not None and tcmalloc["LD_PRELOAD"] == "/opt/libtcmalloc.so"
    assert int(tcmalloc["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no line per block over 1 GiB


@pytest.mark.parametrize(
    ("choice", "preloaded", "found"),
    [("glibc", "", "/opt/libtcmalloc.so"), ("auto", "/usr/lib/libjemalloc.so.2", "/opt/libtcmalloc.so"),
     ("auto", "", None)],
)  # fmt: skip
def test_nothing_is_preloaded_where_glibc_is_chosen_an_allocator_is_preloaded_already_or_none_is_installed(
    clean_environment, monkeypatch, choice, preloaded, found
):
    monkeypatch.setenv(allocator.CHOICE_VARIABLE, choice)
    monkeypatch.setattr(allocator, "installed", lambda name: found)
    assert allocator.preload_environment({"LD_PRELOAD": preloaded}) is None


def test_an_allocator_asked_for_that_is_missing_or_unknown_is_a_one_line_error_naming_the_fix(
    clean_environment, monkeypatch
):
    monkeypatch.setattr(allocator, "installed", lambda name: None)
    monkeypatch.setenv(allocator.CHOICE_VARIABLE, "tcmalloc")
    with pytest.raises(UserError, match="tcmalloc: its library is not installed; install libtcmalloc-minimal4"):
        allocator.preload_environment({})
    monkeypatch.setenv(allocator.CHOICE_VARIABLE, "mimalloc")
    with pytest.raises(UserError, match="mimalloc is not an allocator: use auto, tcmalloc, jemalloc or glibc"):
        allocator.preload_environment({})


def test_glibcs_threshold_is_left_alone_where_another_allocator_runs(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(allocator, "in_use", lambda: "tcmalloc")
    assert heap.large_blocks_returned() is False


EXPECTED = next((name for name in allocator.LIBRARIES if allocator.installed(name)), "glibc")


@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_a_run_of_the_command_trains_on_the_installed_allocator_and_records_it(tmp_path, choice):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", allocator.CHOICE_VARIABLE: choice}
    environment.pop(allocator.TRIED, None)
    command = [sys.executable, "-m", "accel_trainer", "train", "mlp", "max_steps=1", "eval_every_steps=0",
               "report=false", f"output_dir={tmp_path}"]  # fmt: skip
    subprocess.run(command, env=environment, check=True, capture_output=True, timeout=300)

    start = json.loads((tmp_path / "run_info.json").read_text())["starts"][-1]
    assert start["host_allocator"] == (EXPECTED if choice == "auto" else "glibc")


RELEASE_PROBE = """
from accel_trainer.host import allocator
def resident_mib():
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
before = resident_mib()
blocks = [bytearray(1 << 20) for _ in range(300)]
del blocks
kept = resident_mib()
allocator.release_free_memory()
print(allocator.in_use(), before, kept, resident_mib())
"""


@pytest.mark.parametrize("name", ["glibc", *allocator.LIBRARIES])
def test_memory_freed_in_a_phase_goes_back_to_the_system_on_every_allocator(name):
    library = None if name == "glibc" else allocator.installed(name)
    if name != "glibc" and library is None:
        pytest.skip(f"{name} is not installed here")
    environment = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    environment.update(allocator.QUIET.get(name, {}), **({"LD_PRELOAD": library} if library else {}))
    probe = subprocess.run([sys.executable, "-c", RELEASE_PROBE], env=environment, check=True, capture_output=True,
                           text=True, timeout=120)  # fmt: skip

    running, before, kept, released = probe.stdout.split()
    assert running == name
    assert int(released) < int(before) + 50, f"300 MiB freed, {kept} MiB held, {released} MiB after the release"

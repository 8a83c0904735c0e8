"""A Ctrl-C ends a test session whole: pytest, its xdist workers and every process a test started (issue 52).

A small session of the suite's two kinds of training, each training until stopped: one in pytest's own process
(`at.train`, whose stop handlers take a SIGINT as "save and stop": its test failed and the session went on to the
next test), the other on a layout launch (`train_and_dump`: a launcher and two workers in sessions of their own,
which no Ctrl-C reaches). Once they train, a SIGINT to the session's process group, as a terminal's Ctrl-C: pytest
exits 2 with its interrupted summary within 30 s, no test failed and none started after it, and none of the
session's processes is left (each carries the tag of the session, tests/launches.py). Two sessions:
- `pytest -n 2` (as `make test`), started with SIGINT ignored, as `make test &` from a script is (bash starts a
  background job so): it ignored every Ctrl-C and trained on, all 9 of its processes, while the framework's
  processes stopped on it. Started in a terminal it ended, but its in-process run's worker went on to the next test
  first; from its start every pytest process now takes SIGINT, so the terminal's case is this one;
- one pytest process (as `make test-slow`), started as a terminal's foreground job, its Ctrl-C taken by the
  in-process run: its test failed and the next one ran, exit status 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import launches
import pytest

from conftest import REPO, SLOW_STEP, WORKERS, clean_env, logged_steps, wait_for

pytestmark = pytest.mark.multiprocess

ENDED_WITHIN_S = 30

IN_PROCESS = """
from pathlib import Path

import accel_trainer as at

at.registry.discover_recipes([Path({recipes!r})])


def test_trains_in_pytests_process():
    at.train("mlp_slow", output_dir={run!r}, max_steps=100000, log_every_steps=1, eval_every_steps=0,
             save_every_steps=0, show_progress_bar=False, report=False)


def test_after_it():
    Path({after!r}).touch()  # a test that starts after the Ctrl-C: the session went on
"""

ON_A_LAYOUT_LAUNCH = """
from conftest import train_and_dump


def test_trains_on_a_layout_launch():
    train_and_dump("cpu_ddp", {run!r}, "mlp_slow", "max_steps=100000", "log_every_steps=1", "eval_every_steps=0",
                   "save_every_steps=0", world_size=2)
"""

IGNORING_SIGINT = ["bash", "-c", "trap '' INT; exec \"$@\"", "bash"]
"""Start a command with SIGINT ignored, as bash starts a background job (`make test &`) of a script."""

SESSIONS = {  # pytest's options, how the session is started, and its test modules
    "xdist-started-ignoring-sigint": (["-n", "2", "--dist", "loadfile"], IGNORING_SIGINT,
                                      {"in_process": IN_PROCESS, "layout_launch": ON_A_LAYOUT_LAUNCH}),
    "one-process-started-in-a-terminal": ([], [], {"in_process": IN_PROCESS}),
}  # fmt: skip


@pytest.mark.parametrize("started", SESSIONS)
def test_a_ctrl_c_ends_the_session_and_every_process_it_started_within_30_s(started, tmp_path):
    options, starter, modules = SESSIONS[started]
    runs = {name: tmp_path / f"run_{name}" for name in modules}
    after, temporary = tmp_path / "after", tmp_path / "tmp"
    temporary.mkdir()
    for name, source in modules.items():
        values = dict(recipes=str(WORKERS / "recipes"), run=str(runs[name]), after=str(after))
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(source.format(**values)))
    env = {k: v for k, v in clean_env(**SLOW_STEP).items() if not k.startswith("PYTEST_")}
    paths = [str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]  # conftest.py, as `-p conftest`
    env.update(PYTHONPATH=os.pathsep.join(paths), TMPDIR=str(temporary))
    command = [*starter, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q",
               f"--basetemp={tmp_path / 'basetemp'}", *options, *(f"test_{name}.py" for name in modules)]  # fmt: skip
    with open(tmp_path / "session.log", "w") as log:  # a process group of its own: the terminal's foreground one
        session = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True)

    def ours(tags: list[str]) -> bool:  # the session's processes, in whatever process group or session
        return session.launch_tag in tags

    try:
        wait_for(lambda: all(logged_steps(run) >= 1 for run in runs.values()) or session.poll() is not None,
                 timeout_s=180)  # fmt: skip
        assert session.poll() is None, (tmp_path / "session.log").read_text()
        running = len(launches.tagged(ours))
        os.killpg(session.pid, signal.SIGINT)
        pressed = time.monotonic()
        try:
            status = session.wait(timeout=ENDED_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pytest runs on {ENDED_WITHIN_S} s after the Ctrl-C, {len(launches.tagged(ours))} of its"
                        f" {running} processes with it")  # fmt: skip
        while left := launches.tagged(ours):
            assert time.monotonic() - pressed < ENDED_WITHIN_S, f"{len(left)} of {running} processes left"
            time.sleep(0.05)
        seconds = time.monotonic() - pressed
    finally:
        session.kill()  # what is left, if anything: every process tagged with the session

    output = (tmp_path / "session.log").read_text()
    print(f"{started}: {running} processes, all gone {seconds:.1f} s after the Ctrl-C\n{output[-1500:]}")
    assert status == pytest.ExitCode.INTERRUPTED and "KeyboardInterrupt" in output, output
    assert " failed" not in output.splitlines()[-1], output  # the in-process run's Preempted is no failure
    assert not after.exists(), output  # no test started after the Ctrl-C

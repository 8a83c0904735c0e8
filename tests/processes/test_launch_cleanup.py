"""A test session killed outright leaves none of its processes running (tests/launches.py).

- A pytest session killed by SIGKILL during a 2-process `accelerate launch` (`accelerate_launch`, as the tests of
  a launch start theirs): within seconds none of the session's processes is left, the launcher's two workers
  (each in a session of its own, torch's) included.
- `pytest -n 1` whose process group is killed by SIGKILL, as a CI time limit kills `make test` (its controller
  and xdist workers at once), while its worker trains on a layout launch (`train_and_dump`: the long-lived
  launches, in sessions of their own, 44 processes of were once left): the same.
- `Popen.kill()` of a 2-process launch, which subprocess.run calls on a timeout, ends its workers too.
- `at.train(num_processes=2)` whose caller is killed: its workers, forked with torch's PR_SET_PDEATHSIG=SIGINT,
  stop as on a Ctrl-C (they save) and exit.
Each counts the processes before the kill too: what it sees vanish was there, alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    REPO,
    SLOW_STEP,
    TEST_OVERRIDES,
    WORKERS,
    clean_env,
    free_port,
    logged_steps,
    wait_for,
)

pytestmark = pytest.mark.multiprocess

GONE_WITHIN_S = 15

SLEEPER = """\
import os, sys, time
from pathlib import Path

Path(sys.argv[0]).with_name(f"started.{os.environ['RANK']}").touch()
time.sleep(600)
"""

SESSIONS = {  # what is killed: a pytest, or the group of a `pytest -n 1`; the test it runs
    "pytest": """
        from conftest import accelerate_launch

        def test_a_launch_that_outlives_its_session():
            accelerate_launch("cpu_ddp", {marker!r})
        """,
    "xdist-process-group": """
        from conftest import train_and_dump

        def test_a_layout_launch_that_outlives_its_session():
            train_and_dump("cpu_ddp", {run!r}, "mlp_slow", "max_steps=100000", "log_every_steps=1",
                           "eval_every_steps=0", "save_every_steps=0", world_size=2)
        """,
}


def live_processes() -> dict[int, tuple[int, str]]:
    """Every process that has not exited (zombies left out): its parent's pid and its command line."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[0] != "Z":
            found[int(entry.name)] = int(stat[1]), cmdline
    return found


def process_tree(root: int) -> set[int]:
    """`root` and its live descendants."""
    processes, tree = live_processes(), {root}
    while grown := {pid for pid, (parent, _) in processes.items() if parent in tree} - tree:
        tree |= grown
    return tree & {root, *processes}


def holding(marker: str) -> set[int]:
    return {pid for pid, (_, cmdline) in live_processes().items() if marker in cmdline}


def wait_until_gone(pids: set[int]) -> float:
    """Seconds until none of `pids` is alive; fails after GONE_WITHIN_S, naming the survivors."""
    start = time.monotonic()
    while left := pids & set(live_processes()):
        assert time.monotonic() - start < GONE_WITHIN_S, f"{len(left)} of {len(pids)} left: {sorted(left)}"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("killed", SESSIONS)
def test_a_session_killed_by_sigkill_leaves_none_of_its_launches_running(killed, tmp_path):
    launch_folder, run = tmp_path / "launch", tmp_path / "run"
    launch_folder.mkdir()
    sleeper = launch_folder / "sleeps.py"
    sleeper.write_text(SLEEPER)
    # the launch's processes are those whose command line holds `marker`; a layout launch's, its folder in TMPDIR
    marker = str(sleeper) if killed == "pytest" else str(launch_folder)
    test_file = tmp_path / "test_killed_session.py"
    test_file.write_text(textwrap.dedent(SESSIONS[killed].format(marker=marker, run=str(run))))
    env = {k: v for k, v in clean_env(**SLOW_STEP).items() if not k.startswith("PYTEST_")}
    paths = [str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]  # conftest.py, as `-p conftest`
    env.update(PYTHONPATH=os.pathsep.join(paths), TMPDIR=str(launch_folder))
    command = [BIN / "python", "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q",
               f"--basetemp={tmp_path / 'basetemp'}", *(["-n", "1"] if killed != "pytest" else []),
               test_file]  # fmt: skip
    with open(tmp_path / "session.log", "w") as log:  # in a group of its own, which the test may kill
        session = subprocess.Popen([str(part) for part in command], cwd=tmp_path, env=env, stdout=log, stderr=log,
                                   start_new_session=True)  # fmt: skip
    try:
        started = (lambda: len(list(launch_folder.glob("started.*"))) == 2) if killed == "pytest" else (
            lambda: logged_steps(run) >= 1)  # fmt: skip
        wait_for(lambda: started() or session.poll() is not None, timeout_s=180)
        assert session.poll() is None, (tmp_path / "session.log").read_text()
        launch, tree = holding(marker), process_tree(session.pid)
        assert len(launch) == 3 and launch <= tree, (launch, tree)  # the launcher and its 2 workers, alive
        if killed == "pytest":
            os.kill(session.pid, signal.SIGKILL)
        else:
            os.killpg(session.pid, signal.SIGKILL)
        session.wait()
        seconds = wait_until_gone(tree)
        print(f"{killed} killed: {len(tree)} processes, {len(launch)} of its launch; all gone in {seconds:.2f} s")
    finally:
        session.kill()  # what is left, if anything: the whole tagged launch


def test_a_launch_killed_as_on_a_timeout_ends_with_its_workers(tmp_path):
    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text(SLEEPER)
    command = [*ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs/cpu_ddp.yaml", "--main_process_port",
               free_port(), sleeper]  # fmt: skip
    launch = subprocess.Popen([str(part) for part in command], cwd=REPO, env=clean_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: len(list(tmp_path.glob("started.*"))) == 2 or launch.poll() is not None, timeout_s=180)
        processes = holding(str(sleeper))
        assert len(processes) == 3, processes  # the launcher and its 2 workers, each in a session of its own
    finally:
        launch.kill()  # subprocess.run's on a timeout
    seconds = wait_until_gone(processes)
    print(f"a killed launch: {len(processes)} processes gone in {seconds:.2f} s")


def test_the_workers_of_at_train_end_when_its_caller_is_killed(tmp_path):
    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    worker = [WORKERS / "signalled_run.py", "--notebook", "2", "mlp_slow", "max_steps=100000", "log_every_steps=1",
              "eval_every_steps=0", "save_every_steps=0", f"output_dir={run_dir}", *TEST_OVERRIDES]  # fmt: skip
    with open(tmp_path / "caller.log", "w") as log:
        caller = subprocess.Popen([str(BIN / "python"), *map(str, worker)], cwd=REPO, stdout=log, stderr=log,
                                  env=clean_env(ACCEL_TEST_MARKERS=str(markers), **SLOW_STEP))  # fmt: skip
    try:
        wait_for(lambda: logged_steps(run_dir) >= 1 or caller.poll() is not None, timeout_s=180)
        assert caller.poll() is None, (tmp_path / "caller.log").read_text()
        workers = process_tree(caller.pid) - {caller.pid}
        assert len(workers) == 2, workers
        caller.send_signal(signal.SIGKILL)  # the caller alone, as the OOM killer or a dead notebook kernel does
        caller.wait()
        seconds = wait_until_gone(workers)
        print(f"at.train's caller killed: its {len(workers)} workers gone in {seconds:.2f} s")
    finally:
        caller.kill()
    assert files.complete_checkpoints(run_dir), (tmp_path / "caller.log").read_text()  # stopped, saved

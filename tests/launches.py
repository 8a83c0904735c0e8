"""Every process a test starts ends with the pytest process that started it, even one killed by SIGKILL.

Why a mechanism of its own: a pytest killed outright (kill -9, a CI time limit, the OOM killer) runs no
`finally`, no fixture teardown and no atexit (SIGKILL cannot be caught), so `LayoutLaunches.end_all` never ends
the long-lived layout launches; and killing a launcher does not end its workers: torch's elastic agent (torchrun,
and accelerate launch's multi-process launcher, which runs it) starts each worker in a session of its own
(start_new_session=True) with no parent-death signal, and an agent killed by SIGKILL cannot pass anything on, so
its workers are reparented and run on (a layout launch's wait for requests forever): 44 processes holding 12 GB
after one killed `make test`. Under pytest-xdist, a worker whose controller alone was killed runs on while its
test waits in a call (seen: a 40 s sleep ran to its end), and a CI time limit that kills `make test`'s process group
takes the controller and its workers at once; that group is no handle on the launches either, since each of
torch's workers, and each layout launch, is in a session of its own.

How: one hook on subprocess.Popen (installed by conftest.py, in every pytest process, xdist's controller included)
puts `ACCEL_TEST_LAUNCH=<session>.<n>` in the environment of every process this pytest process starts (appended
after a '/' to the tag it inherited, when pytest itself was started by a tagged one). Every descendant inherits it
through any session, process group or reparenting (torch hands its workers the launcher's environment; a fork
keeps it), so a launch's processes are the ones whose /proc/<pid>/environ carries its tag. Then:
- a reaper (this file run as a script), started in a session of its own at this pytest process's first launch,
  waits on a pidfd of it; when it ends, however it ended, the reaper SIGKILLs every process tagged with this
  session until none is left. The xdist controller's reaper so ends the xdist workers (started through the hook
  too) and all their launches;
- `Popen.kill()` of a tagged process (what subprocess.run does on a timeout, what a test's `finally` calls)
  kills its whole launch, grandchildren in sessions of their own included.
A process that has exited but is not yet reaped (a zombie) has an empty environ: it is not counted, it holds
nothing. Not PR_SET_PDEATHSIG on the launcher: it would end the launcher alone, and a killed agent passes nothing
on to its workers. Not a wrapper process around each launch: a test's `Popen.pid` would no longer be the launcher
that tests signal (test_preemption.py relies on torch's agent forwarding a signal), nor its exit status the
launcher's. Linux only (/proc; pidfd_open from Linux 5.3, else the reaper polls), as CI is; elsewhere the hook is
not installed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

VARIABLE = "ACCEL_TEST_LAUNCH"
SESSION = secrets.token_hex(6)
"""This pytest process's tag prefix (random: nested pytest sessions and other checkouts' sessions differ)."""

_numbers = itertools.count()
_lock = threading.RLock()
_reaper: list[subprocess.Popen | None] = []  # this process's reaper, once started
_original_init = subprocess.Popen.__init__
_original_kill = subprocess.Popen.kill


def tagged(belongs: Callable[[list[str]], bool]) -> list[int]:
    """Pids of the live processes (not this one) whose launch tags (ACCEL_TEST_LAUNCH, split at '/') `belongs`."""
    prefix, found = f"{VARIABLE}=".encode(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"{entry.path}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        tags = [v[len(prefix) :].decode(errors="replace").split("/") for v in variables if v.startswith(prefix)]
        if tags and belongs(tags[0]):
            found.append(int(entry.name))
    return found


def kill_tagged(belongs: Callable[[list[str]], bool], timeout_s: float = 10.0) -> None:
    """SIGKILL the processes `tagged` selects, again until none is left (a launcher may be starting more)."""
    deadline = time.monotonic() + timeout_s
    while (pids := tagged(belongs)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def of_session(session: str) -> Callable[[list[str]], bool]:
    return lambda tags: any(tag.startswith(f"{session}.") for tag in tags)


def _start_reaper() -> None:
    with _lock:  # re-entrant: the reaper's own start passes through the hook
        if _reaper:
            return
        _reaper.append(None)
        _reaper[0] = subprocess.Popen(
            [sys.executable, "-I", __file__, SESSION, str(os.getpid())],
            stdin=subprocess.DEVNULL,  # not xdist's channel (a worker's stdin/stdout): its EOF ends the worker
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of the signals to pytest's group (a terminal's Ctrl-C)
            cwd="/",
        )


def _tagging_init(self: subprocess.Popen, args, *more, **options) -> None:
    _start_reaper()
    base = os.environ if options.get("env") is None else options["env"]
    self.launch_tag = f"{SESSION}.{next(_numbers)}"  # type: ignore[attr-defined]
    inherited = base.get(VARIABLE)
    options["env"] = {**base, VARIABLE: f"{inherited}/{self.launch_tag}" if inherited else self.launch_tag}
    _original_init(self, args, *more, **options)


def _kill_launch(self: subprocess.Popen) -> None:
    _original_kill(self)
    tag = getattr(self, "launch_tag", None)
    if tag is not None:
        kill_tagged(lambda tags: tag in tags)


def install() -> None:
    """Tag every process this process starts from now on, and kill a launch whole on `Popen.kill()`."""
    if sys.platform.startswith("linux") and subprocess.Popen.__init__ is _original_init:
        subprocess.Popen.__init__ = _tagging_init  # type: ignore[method-assign]
        subprocess.Popen.kill = _kill_launch  # type: ignore[method-assign]


def reap(session: str, parent: int) -> None:
    """The reaper: wait for `parent` (the pytest process that started it) to end, then kill its session's
    processes. Checked against getppid, so a pid reused after an early death is not waited on."""
    try:
        pidfd = os.pidfd_open(parent)
        if os.getppid() == parent:
            select.select([pidfd], [], [])
    except ProcessLookupError:  # already gone
        pass
    except OSError:  # no pidfd_open (Linux < 5.3, some sandboxes): look every 0.2 s
        while os.getppid() == parent:
            time.sleep(0.2)
    kill_tagged(of_session(session))


if __name__ == "__main__":
    reap(sys.argv[1], int(sys.argv[2]))

"""Preemption: SIGTERM, SIGINT or SIGUSR1, or a spent `max_time`, become a checkpoint and a clean exit at the
next step boundary.

A signal only sets a flag. At the end of every optimizer step all processes combine their flags, so they
agree on the step to stop at even when only one of them was signalled or the signal arrived during
evaluation; the loop then saves and raises `Preempted`, and the command-line entry exits with
`EXIT_PREEMPTED` (75, EX_TEMPFAIL: "try again later"; the same command with `resume=auto` continues).
The flags are combined over a CPU (gloo) side group so that checking costs no device synchronisation.

The handlers are installed before anything else a run does (`catch_stop_signals`, from training.main, the
workers of processes.py and `at.train`), so a signal during the set-up (the rendezvous, loading data,
restoring a checkpoint) is kept for the first step boundary instead of killing one process mid-rendezvous.
A signal often comes twice: a scheduler signals every process and the launcher (torchrun, accelerate
launch, notebook_launcher's elastic agent) forwards its own copy a millisecond later, and a terminal's Ctrl-C
reaches the forked workers of `at.train(num_processes=N)` both directly and through the launcher. So a repeat
within REPEAT_WINDOW_S of the first signal is a copy and ignored; a later one is a person's second Ctrl-C and
gets the default action at once (KeyboardInterrupt, or death by the signal): never the handler that was
there before, which in a forked worker is torch's launcher handler and turned the copy into an error.
`max_time` (e.g. 2h30m) is a wall-clock budget counted from the start of the run: once spent, the run stops
the same way, so a scheduler's job can end cleanly before its allocation does and the next job continue.

Python runs signal handlers in the main thread only, and installs them only there. A run in another thread (Ray
Train's workers run the training function in one) is stopped the same way when its process's main thread
installs the handlers (deploy/ray/train_recipe.py, from a Ray worker callback): they set the flag the run's thread
polls. A stop asked for by something other than a signal (Ray's preemption notice) sets it with `request_stop`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accel_trainer.config.fields import parse_duration
from accel_trainer.observe.breadcrumb import where

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_WINDOW_S = 1.0
"""A stop signal this soon after the first is a copy (a launcher forwards within milliseconds), not a second press."""
_DEFAULT_ACTIONS: dict[int, Any] = {signal.SIGINT: signal.default_int_handler}  # the others: SIG_DFL
# The first stop request's name ("" until one comes), and the time.monotonic() of the first stop signal (0.0 until one).
_received: list[Any] = ["", 0.0]


def catch_stop_signals() -> dict[int, Any]:
    """Install the stop handlers, forgetting an earlier run's signal; the handlers they replaced, to give back.

    Nothing is installed off the main thread (Python allows handlers only there) or where they already are
    (a run inside a run's entry point): then the result is empty.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(SIGNALS[0]) == _handle:
        return {}
    _received[:] = ["", 0.0]
    return {sig: signal.signal(sig, _handle) for sig in SIGNALS}


@contextlib.contextmanager
def stop_signals_caught() -> Iterator[None]:
    """The stop handlers for the duration of a block (an `at.train` in a notebook gets its own back after)."""
    previous = catch_stop_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def received_signal() -> str:
    """The name of the first stop signal (or `request_stop` reason) this process received since its handlers were
    installed, or ""."""
    return str(_received[0])


def request_stop(reason: str) -> None:
    """Stop the run at its next step boundary, as a stop signal does, from any thread; `reason` names what asked.

    For a request that is no signal: deploy/ray/train_recipe.py passes on Ray Train's preemption notice. The first
    request or signal is the one the run reports; a signal after a request is still a first signal, not a second
    press (a node that was given notice is then often stopped with SIGTERM while the run saves).
    """
    if not _received[0]:
        _received[0] = reason
        # Said at once, so a process stuck in its step (a hang) is still seen and says where it was; one raw
        # write: print() here could raise into the step (BrokenPipeError when `| tee` died of the same Ctrl-C,
        # a reentrant call on a stream the step was writing to).
        _say(f"{reason} received during {where()}")


def _handle(signum: int, frame: Any) -> None:
    """Record the first stop signal; ignore its copies; give a later one (a second press) its default action."""
    now = time.monotonic()
    if not _received[1]:
        _received[1] = now
        request_stop(signal.Signals(signum).name)
    elif now - _received[1] >= REPEAT_WINDOW_S:
        _say(f"a second {signal.Signals(signum).name}: stopping at once, without a checkpoint")
        signal.signal(signum, _DEFAULT_ACTIONS.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # a closed or broken stderr: nothing to tell, nothing to raise
        os.write(2, f"accel-trainer: rank {os.environ.get('RANK', '0')}: {text}\n".encode())


class Preempted(Exception):
    """Training stopped early on a signal after saving a checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: Any):
        super().__init__(signal_name, step, checkpoint)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.how_to_continue = "rerun the same command to continue"

    def __str__(self) -> str:
        where = f"stopped by {self.signal_name} after step {self.step}; checkpoint {self.checkpoint}"
        return f"{where}; {self.how_to_continue}"


def _cpu_group(timeout_s: float) -> Any:
    """A process group whose collectives run on CPU tensors: the default one when it is gloo.

    A side group is created only for other backends (NCCL). Creating one on gloo was also wrong after an
    elastic restart: its rendezvous read the dead attempt's addresses from the launcher's store. The side
    group gets the run's collective timeout, not the 30-minute default.
    """
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class PreemptionWatcher:
    """Decides, with the other processes, when to stop: a context manager around the step loop.

    The handlers are normally installed already (`catch_stop_signals` at the start of the run), and a signal
    that came during the set-up is then seen at the first check; otherwise they are installed here.
    """

    def __init__(self, num_processes: int, timeout_s: float, max_time: str = "", started: float | None = None):
        self.signal_name = ""
        self._group = _cpu_group(timeout_s) if num_processes > 1 else None
        self._previous: dict[int, Any] = {}
        self._max_time = max_time
        self._deadline = (started or time.time()) + parse_duration(max_time) if max_time else None

    def __enter__(self) -> PreemptionWatcher:
        self._previous = catch_stop_signals()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self) -> bool:
        """Whether any process was signalled or ran out of max_time; a collective: every process calls it after
        every step."""
        if not self.signal_name:
            self.signal_name = received_signal()
        if self._deadline is not None and not self.signal_name and time.time() >= self._deadline:
            self.signal_name = f"max_time={self._max_time}"
        if self._group is None:
            return bool(self.signal_name)
        # 0: go on; 1: a signal; 2: the budget, which every process has: each says why the run stopped, not the
        # first process whose clock passed the deadline alone (the others said "a signal to another process")
        reason = 2 if self.signal_name.startswith("max_time=") else int(bool(self.signal_name))
        flag = torch.tensor([reason], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and not self.signal_name:
            # This process's own copy may have arrived while it waited in the collective: Python runs the handler
            # only once the call returns (a terminal's Ctrl-C reaches every process, not always at the same time).
            budget = f"max_time={self._max_time}" if flag.item() == 2 else ""
            self.signal_name = received_signal() or budget or "a signal to another process"
        return bool(flag.item())

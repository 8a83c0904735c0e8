"""Preemption: SIGTERM, SIGINT or SIGUSR1, or a spent `max_time`, become a checkpoint and a clean exit at the
next step boundary.

A signal only sets a flag. At the end of every optimizer step all processes combine their flags, so they
agree on the step to stop at even when only one of them was signalled or the signal arrived during
evaluation; the loop then saves and raises `Preempted`, and the command-line entry exits with
`EXIT_PREEMPTED` (75, EX_TEMPFAIL: "try again later"; the same command with `resume=auto` continues).
The flags are combined over a CPU (gloo) side group so that checking costs no device synchronisation.
A second signal restores the default handler's behaviour (a second Ctrl-C interrupts at once).
`max_time` (e.g. 2h30m) is a wall-clock budget counted from the start of the run: once spent, the run stops
the same way, so a scheduler's job can end cleanly before its allocation does and the next job continue.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError

EXIT_PREEMPTED = 75
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_where: list[Any] = ["setting up", None]  # (phase, step): formatted only when a report needs it


def parse_duration(text: str) -> float:
    """Seconds of a duration like 2h30m, 90m, 45s or 1d (units d, h, m, s, in any combination).

    Raises:
        ConfigError: any other text.
    """
    parts = _DURATION.findall(text)
    if not text or "".join(number + unit for number, unit in parts) != text.replace(" ", ""):
        raise ConfigError(f"max_time={text!r}: write a duration such as 2h30m, 90m or 45s (units d, h, m, s)")
    return sum(float(number) * _SECONDS[unit] for number, unit in parts)


def note_where(phase: str, step: int | None = None) -> None:
    """Record what this process is doing ("the forward of step", 12), for one-line reports; called several times
    a step, so it stores and does not format."""
    _where[0], _where[1] = phase, step


def where() -> str:
    """What the process was doing: "the forward of step 12"."""
    phase, step = _where
    return phase if step is None else f"{phase} {step}"


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
    """Installs the signal handlers for the duration of a run (a context manager)."""

    def __init__(self, num_processes: int, timeout_s: float, max_time: str = "", started: float | None = None):
        self.signal_name = ""
        self._group = _cpu_group(timeout_s) if num_processes > 1 else None
        self._previous: dict[int, Any] = {}
        self._max_time = max_time
        self._deadline = (started or time.time()) + parse_duration(max_time) if max_time else None

    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Said at once: a process stuck in its step (a hang) is still seen, and says where it was.
        print(f"accel-trainer: rank {rank}: {self.signal_name} received during {where()}", file=sys.stderr, flush=True)

    def should_stop(self) -> bool:
        """Whether any process was signalled or ran out of max_time; a collective: every process calls it after
        every step."""
        if self._deadline is not None and not self.signal_name and time.time() >= self._deadline:
            self.signal_name = f"max_time={self._max_time}"
        if self._group is None:
            return bool(self.signal_name)
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and not self.signal_name:
            self.signal_name = "a signal to another process"
        return bool(flag.item())

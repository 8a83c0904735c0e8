"""A closed stdout (`accel-trainer list | head -3`) ends a command quietly, as it ends a Unix tool.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError: a traceback, and
then another one ("Exception ignored ... BrokenPipeError") when the interpreter flushes stdout on its way out.
The Python documentation's recipe (library/signal.html, "Note on SIGPIPE") is followed: stdout is pointed at
devnull, so that the last flush succeeds, and the command exits with status 1 and says nothing.

Only stdout's own pipe is treated so: a BrokenPipeError from any other pipe (a socket, a subprocess) is a real
error and is raised as it was.

A training run is not a listing: its output's reader most often goes because the same Ctrl-C that stops the run
killed it (`accel-trainer train ... | tee train.log`), and the run's next step line then raised BrokenPipeError
mid-step, which ended the run without the checkpoint the Ctrl-C asks for. During a run (`closed_output_stops`)
a stdout or stderr whose reader has gone writes to devnull from then on and asks the run to stop at its next step
boundary, which saves a checkpoint as a stop signal does (a Ctrl-C's own stop stays the one reported).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO


def stdout_is_closed(error: BaseException) -> bool:
    """Whether `error` is a write to a stdout whose reader has gone; if so stdout now writes to devnull.

    Args:
        error: the exception a command stopped with.

    Returns:
        True for a BrokenPipeError of stdout (after which nothing more reaches the reader anyway).
    """
    if not isinstance(error, BrokenPipeError) or not _reader_gone():
        return False
    _to_devnull(sys.stdout)
    return True


@contextlib.contextmanager
def exit_quietly_when_stdout_closes() -> Iterator[None]:
    """Run a command that prints; a closed stdout ends it with status 1 and no message.

    Raises:
        SystemExit: status 1, when stdout's reader has gone.
    """
    try:
        try:
            yield
        finally:
            sys.stdout.flush()  # here, where a closed stdout is caught, not at the interpreter's exit
    except BrokenPipeError as error:
        if not stdout_is_closed(error):
            raise
        raise SystemExit(1) from None


@contextlib.contextmanager
def closed_output_stops(stop: Callable[[str], None]) -> Iterator[None]:
    """Run a training run whose stdout or stderr may lose its reader: then that stream writes to devnull and
    `stop("a closed stdout")` (or stderr) asks the run to stop at its next step boundary, with its checkpoint."""
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    for name, stream in streams.items():
        if stream is not None:  # None: Python started without that descriptor
            setattr(sys, name, _StopWhenClosed(stream, name, stop))
    try:
        yield
    finally:
        for name, stream in streams.items():
            setattr(sys, name, stream)


class _StopWhenClosed:
    """A text stream whose BrokenPipeError, once its reader is gone, points it at devnull and asks for a stop."""

    def __init__(self, stream: TextIO, name: str, stop: Callable[[str], None]) -> None:
        self._stream, self._name, self._stop = stream, name, stop

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError as error:
            self._closed(error)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError as error:
            self._closed(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _closed(self, error: BrokenPipeError) -> None:
        if not _reader_gone(self._stream):
            raise error
        _to_devnull(self._stream)
        self._stop(f"a closed {self._name}")


def _to_devnull(stream: TextIO) -> None:
    """Point `stream`'s descriptor at devnull: its writes, and its buffered text's flush, succeed unread."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _reader_gone(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stdout) is a pipe with no reader left: poll() says so with POLLERR (POLLHUP on some
    systems)."""
    try:
        descriptor = (stream or sys.stdout).fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no file descriptor, or no poll(): trust the error's word
        return True
    poller.register(descriptor, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))

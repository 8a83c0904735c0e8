"""A closed stdout (`accel-trainer list | head -3`) ends a command quietly, as it ends a Unix tool.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError: a traceback, and
then another one ("Exception ignored ... BrokenPipeError") when the interpreter flushes stdout on its way out.
The Python documentation's recipe (library/signal.html, "Note on SIGPIPE") is followed: stdout is pointed at
devnull, so that the last flush succeeds, and the command exits with status 1 and says nothing.

Only stdout's own pipe is treated so: a BrokenPipeError from any other pipe (a socket, a subprocess) is a real
error and is raised as it was.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterator


def stdout_is_closed(error: BaseException) -> bool:
    """Whether `error` is a write to a stdout whose reader has gone; if so stdout now writes to devnull.

    Args:
        error: the exception a command stopped with.

    Returns:
        True for a BrokenPipeError of stdout (after which nothing more reaches the reader anyway).
    """
    if not isinstance(error, BrokenPipeError) or not _reader_gone():
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
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


def _reader_gone() -> bool:
    """Whether stdout is a pipe with no reader left: poll() says so with POLLERR (POLLHUP on some systems)."""
    try:
        descriptor = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no file descriptor, or no poll(): trust the error's word
        return True
    poller.register(descriptor, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))

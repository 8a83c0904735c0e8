"""Where this process is: the phase of the step it is in, for the one-line reports of a signal, a lost peer or a
hang ("rank 1: lost another process during the backward (and gradient reduction) of step 12").

Noted several times a step, so it stores and does not format; read only when a report needs it.
"""

from __future__ import annotations

from typing import Any

_where: list[Any] = ["setting up", None]  # (phase, step): formatted only when a report needs it


def note_where(phase: str, step: int | None = None) -> None:
    """Record what this process is doing ("the forward of step", 12), for one-line reports; called several times
    a step, so it stores and does not format."""
    _where[0], _where[1] = phase, step


def where() -> str:
    """What the process was doing: "the forward of step 12"."""
    phase, step = _where
    return phase if step is None else f"{phase} {step}"

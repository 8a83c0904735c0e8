"""accel-trainer's own warnings print as their one-line message, without Python's file, line and source line.

Every warning accel-trainer issues begins with "accel-trainer:" and says what to change. Python's default
format puts `.../accel_trainer/training.py:69: UserWarning: ` before it and the `warnings.warn(...)` source line
after it, which tell a user of the library nothing. Each entry point (`at.train`, a recipe's `main`, the
`accel-trainer` command) installs this format; it wraps the format that was there and changes only messages
with that prefix, so a user's own warnings, and those of torch or accelerate, print as before. The category
stays UserWarning: `pytest.warns(UserWarning)` and `-W error::UserWarning` see them as before, and
`warnings.filterwarnings("ignore", message="accel-trainer:")` silences them.
"""

from __future__ import annotations

import warnings
from typing import Any

PREFIX = "accel-trainer:"


def show_our_warnings_as_one_line() -> None:
    """Install the one-line format for accel-trainer's warnings, once per process."""
    default = warnings.formatwarning
    if getattr(default, "accel_trainer", False):  # installed by an earlier entry point in this process
        return

    def format_warning(message: Any, category: Any, filename: str, lineno: int, line: str | None = None) -> str:
        if str(message).startswith(PREFIX):
            return f"{message}\n"
        return default(message, category, filename, lineno, line)

    format_warning.accel_trainer = True  # type: ignore[attr-defined]
    warnings.formatwarning = format_warning  # type: ignore[assignment]

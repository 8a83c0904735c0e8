"""User-facing errors, and how a crash in recipe code is shown.

Anything the user can fix (a bad override, an unknown recipe, a wrong layout) raises a subclass of
`UserError`. The command-line entry points print such an error as one line and exit with status 2 instead
of showing a traceback. Any other exception is a bug: when it comes from recipe code, `describe_crash`
shows the recipe's own frames only (not 40 lines of the loop, accelerate and torch); a crash inside the
framework keeps its whole traceback, and `ACCEL_TRAINER_FULL_TRACEBACK=1` always shows everything. On a layout
of several processes that the command started, a refusal every process makes is said once (`say_user_error`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


class UserError(Exception):
    """A problem in what the user asked for; the message names the problem and the fix."""


class ConfigError(UserError):
    """A configuration key, value or file is wrong."""


class RecipeError(UserError):
    """A recipe is unknown, registered twice, or breaks the recipe contract."""


class LayoutError(UserError):
    """The processes that were started do not form the layout that was asked for."""


class EstimateCrashed(Exception):
    """A rank's `accel-trainer estimate` failed in recipe or framework code: its description, as a run's crash is
    described (`describe_crash`)."""


def describe_crash(error: BaseException) -> str:
    """The recipe's frames of a traceback, the exception, and one line naming the recipe method."""
    if os.environ.get("ACCEL_TRAINER_FULL_TRACEBACK"):  # as the run's own crash (training.py), for estimate's ranks
        return "".join(traceback.format_exception(error)).rstrip()
    every = traceback.extract_tb(error.__traceback__)
    ours = [_is_recipe_code(frame.filename) for frame in every]
    # Recipe code called by the framework (the loop calling compute_loss) is below a framework frame; a
    # traceback whose only user frame is the script's `at.main(...)` line is a framework bug: show it whole.
    first_framework = ours.index(False) if False in ours else len(ours)
    if not any(ours[first_framework:]):
        return "".join(traceback.format_exception(error)).rstrip()
    frames = [frame for frame, mine in zip(every, ours, strict=True) if mine]
    return (
        f"accel-trainer: error in recipe code, in {frames[-1].name} (ACCEL_TRAINER_FULL_TRACEBACK=1 shows every"
        " frame):\n" + "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(error))
    ).rstrip()


def recipe_site(error: BaseException) -> str:
    """Where recipe code raised `error`, as "file:line in function", or "" when no recipe frame did."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _is_recipe_code(frame.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def _is_recipe_code(filename: str) -> bool:
    """Code of the user's: not accel_trainer's, not an installed package's, not Python's frozen modules.

    A notebook cell's or `python -c`'s code has a name in angle brackets (`<ipython-input-3-...>`, `<string>`).
    """
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    path = Path(filename)
    return not (_PACKAGE in path.resolve().parents or "site-packages" in path.parts)


ERROR_LINES_VARIABLE = "ACCEL_TRAINER_ERROR_LINES"
"""A folder where the processes of a layout the command started leave their refusals (processes.py)."""


def say_user_error(line: str) -> None:
    """A refusal's line, in one write. A process of a layout this command started leaves it for the starting
    process, which says each distinct line once the processes have ended (`say_error_lines_left`): the same
    refusal was printed by every process. Alone, or under a plain `accelerate launch`, it goes to stderr.

    Under a plain `accelerate launch` or `torchrun`, whose launcher (torch's agent, in the launching process, out
    of a worker's reach) prints its `ChildFailedError` table after any worker exits non-zero, the line also goes
    to the error file torch's agent gives each worker (TORCHELASTIC_ERROR_FILE), in the plain-message form it
    reads, so that the table's root cause is this line, not "To enable traceback see: ..."."""
    folder = os.environ.get(ERROR_LINES_VARIABLE)
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, os.environ.get("RANK", "0")).write_text(line)
            return
    sys.stderr.write(line)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            message = {"message": line.strip(), "timestamp": int(time.time())}
            Path(error_file).write_text(json.dumps(message))


def say_error_lines_left(folder: Path) -> None:
    """The refusals the processes left in `folder`, each distinct line once, in rank order."""
    ranks = sorted((path for path in folder.iterdir() if path.name.isdigit()), key=lambda path: int(path.name))
    for line in dict.fromkeys(path.read_text() for path in ranks):
        sys.stderr.write(line)

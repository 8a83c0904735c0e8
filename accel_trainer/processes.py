"""`at.train(..., num_processes=N)`: train on N processes started from Python, as from a notebook.

accelerate's `notebook_launcher` forks N workers under torch's elastic launcher (so recipes defined in a
notebook or a script are known to them), each of which calls `at.train` and joins the process group; the
main worker writes its `TrainResult` to a file the caller reads back. A worker that fails writes its
exception instead and exits quietly, and the caller raises it again: the same type and message as on one
process (a `RecipeError`, a `KeyError` from recipe code), with the recipe's frames printed once, not the
launcher's 40 lines of `ChildFailedError`.

notebook_launcher's own line, "Launching training on 2 CUDAs.", names CUDA whenever no other accelerator
is installed, a CPU-only machine included; it is replaced by a line of ours that says what the workers use.

Signals: the workers are forked into the caller's process group, so a terminal's Ctrl-C reaches each of them
directly and again through the launcher, which forwards it a millisecond later. Each worker installs the
stop handlers first thing (stopping/signals.py), replacing the launcher's handler it inherited, which turned the
copy into an error; the run saves, and the caller gets `Preempted` back. The launcher kills workers that
have not ended TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after a signal (30 by default): 120 here, unless set,
so that a stop's last step and save fit. A second Ctrl-C (after signals.REPEAT_WINDOW_S) quits at once:
the caller gets KeyboardInterrupt. A caller killed outright (SIGKILL, the OOM killer) leaves no worker running:
torch forks each with PR_SET_PDEATHSIG=SIGINT, so they stop as on a Ctrl-C, save and exit (unlike torchrun's
workers, which outlive a killed agent: tests/processes/test_launch_cleanup.py).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from accel_trainer.config.command_line import CommandLine
from accel_trainer.errors import ERROR_LINES_VARIABLE, UserError, describe_crash, say_error_lines_left
from accel_trainer.parallel.launch_fixes import launched_world_size
from accel_trainer.parallel.layout_file import Layout, apply_layout, launch_layout, read_layout
from accel_trainer.stopping.signals import EXIT_PREEMPTED

SHUTDOWN_TIMEOUT_S = 120
"""Seconds the launcher waits for its workers after a signal before SIGKILL (torch's default: 30)."""


def launch_processes(
    train: Callable[..., Any],
    recipe_name: str,
    num_processes: int,
    config_file: str | Path | None,
    overrides: dict[str, Any],
) -> tuple[dict[str, Any], Path]:
    """Run `train` (`at.train`) on `num_processes` forked processes; the main process's metrics and run folder.

    Raises:
        UserError: num_processes is not a positive count, or this process already is a launched worker.
    """
    from accelerate import notebook_launcher

    from accel_trainer.parallel.launch_fixes import forget_accelerate_state

    if num_processes < 1:
        raise UserError(f"num_processes={num_processes}: must be at least 1")
    if launched_world_size() is not None:
        raise UserError(
            f"num_processes={num_processes} from a process a launcher started ({launched_world_size()} processes):"
            " set the process count in the launcher instead"
        )
    forget_accelerate_state()  # notebook_launcher refuses to fork once an Accelerator exists in this process
    with tempfile.TemporaryDirectory() as scratch:
        elastic_log = logging.getLogger("torch.distributed.elastic")
        level = elastic_log.level
        elastic_log.setLevel(logging.CRITICAL)  # its report of a failed worker is the failure we raise below
        try:
            with _our_launch_line(num_processes), _launcher_defaults():
                notebook_launcher(
                    _worker,
                    args=(train, recipe_name, config_file, overrides, scratch),
                    num_processes=num_processes,
                    use_port=str(free_port()),
                    # it sets the workers' precision itself: a layout's (layout=, in this environment) goes through
                    mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
                )
        except Exception as launch_error:  # noqa: BLE001 - replaced by the worker's own exception
            if _is_signal(launch_error, signal.SIGINT) and not list(Path(scratch).glob("error_rank*.json")):
                raise KeyboardInterrupt from launch_error  # a second Ctrl-C: the workers quit without a word
            error = _worker_error(Path(scratch), num_processes)
            expected = isinstance(error, UserError) or type(error).__name__ == "Preempted"
            raise error from (None if expected else launch_error)  # a stop or a user error: no launcher frames
        finally:
            elastic_log.setLevel(level)
        result = json.loads((Path(scratch) / "result.json").read_text())
    return result["metrics"], Path(result["run_dir"])


@contextlib.contextmanager
def _our_launch_line(num_processes: int) -> Iterator[None]:
    """Say what the workers will run on, and silence notebook_launcher's line while it launches them."""
    import torch
    from accelerate import launchers

    # device_count asks NVML and so leaves CUDA uninitialized in this process, as forking its workers needs
    # (torch.cuda.is_available would initialize it); ACCELERATE_USE_CPU is how launch_fixes.wants_cpu decides.
    on_cpu = torch.cuda.device_count() == 0 or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1")
    # flushed: a forked worker would print what is left in this process's buffer once more
    print(
        f"accel-trainer: launching {num_processes} {'CPU processes (gloo)' if on_cpu else 'GPU processes (nccl)'}",
        flush=True,
    )

    def print_but_the_launch_line(*args: Any, **kwargs: Any) -> None:
        if not (args and str(args[0]).startswith("Launching training on")):
            builtins.print(*args, **kwargs)

    launchers.print = print_but_the_launch_line  # type: ignore[attr-defined]  # found before the builtin
    try:
        yield
    finally:
        del launchers.print  # type: ignore[attr-defined]


def _worker(
    train: Callable[..., Any], recipe_name: str, config_file: Any, overrides: dict[str, Any], scratch: str
) -> None:
    from accel_trainer.stopping.signals import Preempted, catch_stop_signals

    catch_stop_signals()  # first: the handlers inherited from the launcher turn its forwarded copy into an error
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = train(recipe_name, config_file=config_file, **overrides)
    except Exception as error:  # noqa: BLE001 - handed to the caller, which raises it again
        report = describe_crash(error) if not isinstance(error, (UserError, Preempted)) else ""
        error_file = Path(scratch) / f"error_rank{rank}.json"
        args = [str(arg) if isinstance(arg, Path) else arg for arg in error.args]  # a Preempted's checkpoint
        plain = all(isinstance(arg, (str, int, float, type(None))) for arg in args)
        error_file.write_text(
            json.dumps(
                {
                    "module": type(error).__module__,
                    "type": type(error).__name__,
                    "args": args if plain else [str(error)],
                    "message": str(error),
                    "report": report,
                    "attributes": _attributes(error),
                }
            )
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # quietly: the caller raises the error once
    if rank == 0:
        Path(scratch, "result.json").write_text(json.dumps({"metrics": result.metrics, "run_dir": str(result.run_dir)}))


def _worker_error(scratch: Path, num_processes: int) -> Exception:
    """The exception of the lowest failed rank, rebuilt as its own type where that type is safe to rebuild."""
    reports = sorted(scratch.glob("error_rank*.json"))
    if not reports:
        return UserError(f"training on {num_processes} processes failed without a report; see their output above")
    error = json.loads(reports[0].read_text())
    if error["report"]:
        print(error["report"], file=sys.stderr)
    kind = _REBUILDABLE.get((error["module"], error["type"]))
    if kind is None:
        return RuntimeError(f"{error['type']}: {error['message']}")
    rebuilt = kind(*error["args"])
    for name, value in error.get("attributes", {}).items():
        setattr(rebuilt, name, value)
    if isinstance(getattr(rebuilt, "checkpoint", None), str):  # a Preempted's folder, a Path again
        rebuilt.checkpoint = Path(rebuilt.checkpoint)  # type: ignore[attr-defined]
    return rebuilt


def _attributes(error: Exception) -> dict[str, str]:
    """What a rebuilt exception needs beyond its arguments: a Preempted's advice on how to continue."""
    advice = getattr(error, "how_to_continue", None)
    return {"how_to_continue": advice} if isinstance(advice, str) else {}


def _is_signal(error: BaseException, signum: int) -> bool:
    """Whether the launcher stopped on `signum` (its SignalException, by name: torch's module may move)."""
    return type(error).__name__ == "SignalException" and getattr(error, "sigval", None) == signum


def launch_on_layout(
    line: CommandLine,
    program: list[str],
    *,
    start: bool = True,
    check: Callable[[Layout], None] | None = None,
) -> int | Layout | None:
    """A command's `layout=` (parallel/layout_file.py). Under a launcher: applied to this process; None. Not
    launched: a one-process layout (or any, with `start=False`) is returned, for the command to run in its
    environment here; the processes of a larger one are started running `program` (this command, less its
    launcher options), and their exit status is returned. `check` refuses, once and here, what every process
    would refuse seconds later (the config's own mistakes)."""
    if line.layout is None:
        return None
    layout = read_layout(line.layout, line.launcher_options)
    if launched_world_size() is not None:
        apply_layout(layout, launched_world_size())
        return None
    if not start or (layout.num_processes == 1 and layout.num_machines == 1):
        return layout
    if check is not None:
        check(layout)
    return start_layout_processes(layout, program)


def end_launched_worker(status: int) -> None:
    """End a launched process of several with `status` once everything is flushed (`os._exit`: about 1 in 20 clean
    2-process gloo runs otherwise aborted at interpreter exit, docs/accelerate-traps.md); else return."""
    if (launched_world_size() or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def start_layout_processes(layout: Layout, program: list[str]) -> int:
    """The processes of `layout` running `program`, started by accelerate's launcher in this process
    (parallel/layout_file.py's `launch_layout`), given time to save after a stop signal; their exit status (75 when
    a signal stopped them: they saved). The launcher passes SIGUSR1 on too (torch's agent forwards only SIGTERM,
    SIGINT, SIGHUP and SIGQUIT by default, and its workers are in a session of their own, which a scheduler's
    signal to the launcher's group does not reach: Slurm's `--signal`, srun's forwarding)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with _launcher_defaults(), tempfile.TemporaryDirectory(prefix="accel-trainer-errors-") as lines:
        os.environ[ERROR_LINES_VARIABLE] = lines
        try:
            return launch_layout(layout, program)
        except SignalException:  # the agent forwarded it to the workers, which saved
            return EXIT_PREEMPTED
        finally:
            del os.environ[ERROR_LINES_VARIABLE]
            say_error_lines_left(Path(lines))


@contextlib.contextmanager
def _launcher_defaults() -> Iterator[None]:
    """torch's launcher settings, from the environment unless the caller set them: time to save after a stop
    signal, and SIGUSR1 forwarded as the other stop signals are (read when accelerate's launcher parses its
    torchrun arguments; notebook_launcher builds its LaunchConfig without them and forwards the default four).
    The caller's signal handlers are given back after: torch's agent, run in this process, installs its own and
    leaves them, and a later Ctrl-C (a notebook's next cell, a test session's) raised its SignalException."""
    settings = {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S),  # torch's LaunchConfig
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    }  # --signals_to_handle; fmt: skip
    unset = [name for name in settings if name not in os.environ]
    os.environ.update({name: settings[name] for name in unset})
    handlers = {
        sig: signal.getsignal(sig)
        for sig in [signal.Signals[name] for name in settings["PET_SIGNALS_TO_HANDLE"].split(",")]
    }
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)
        for sig, handler in handlers.items():  # torch installs its own on the main thread alone, the one to set
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _rebuildable() -> dict[tuple[str, str], type[Exception]]:
    from accel_trainer import errors
    from accel_trainer.checkpoint import files, state_files
    from accel_trainer.stopping import signals

    classes: list[type[Exception]] = [
        errors.UserError,
        errors.ConfigError,
        errors.RecipeError,
        errors.LayoutError,
        files.CheckpointError,
        state_files.StateFileError,
        signals.Preempted,
    ]
    builtin = [getattr(builtins, name) for name in dir(builtins)]
    classes += [kind for kind in builtin if isinstance(kind, type) and issubclass(kind, Exception)]
    return {(kind.__module__, kind.__name__): kind for kind in classes}


_REBUILDABLE = _rebuildable()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a launch's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

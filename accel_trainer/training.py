"""Entry points that run a recipe: `train()` from Python and `main()` for scripts and launchers.

`main("vae")` at the bottom of a recipe file makes all launchers work with the same `key=value` overrides:

    python recipes/vae.py max_steps=100
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/vae.py max_steps=100
    torchrun --nproc_per_node 2 recipes/vae.py max_steps=100
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list
from torch.distributed import DistBackendError

from accel_trainer.checkpoint import run_folder
from accel_trainer.config.advice import config_warnings
from accel_trainer.config.command_line import CommandLine, parse_command_line
from accel_trainer.config.fields import describe_fields, micro_batch_size_given
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import (
    config_to_yaml,
    layout_to_yaml,
    resolve_config,
    resolve_settings,
)
from accel_trainer.console.closed_stdout import closed_output_stops, stdout_is_closed
from accel_trainer.console.import_noise import drop_known_import_noise
from accel_trainer.console.warning_lines import show_our_warnings_as_one_line
from accel_trainer.data.batching import plan_batches, planned_micro_batch_size
from accel_trainer.engine.benchmarks import refuse_sharding_layout
from accel_trainer.engine.heap import large_blocks_returned
from accel_trainer.engine.loop import train_loop
from accel_trainer.errors import LayoutError, UserError, describe_crash, say_user_error
from accel_trainer.observe.breadcrumb import where
from accel_trainer.observe.trackers import check_trackers
from accel_trainer.parallel.accelerator import (
    build_accelerator,
    data_parallel_size_on_layout,
    launch_settings_file,
    settings_on_layout,
)
from accel_trainer.parallel.launch_fixes import forget_accelerate_state, launched_world_size
from accel_trainer.parallel.layout_file import Layout, check_launched_layout, layout_environment, read_layout
from accel_trainer.processes import end_launched_worker, launch_on_layout, launch_processes
from accel_trainer.registry import describe, get_recipe, recipe_name_of
from accel_trainer.stopping.signals import EXIT_PREEMPTED, Preempted, request_stop, stop_signals_caught


@dataclass
class TrainResult:
    """What a finished run returns: its final metrics and where its files are."""

    metrics: dict[str, Any]
    run_dir: Path


def train(
    recipe_name: str,
    *,
    config_file: str | Path | None = None,
    num_processes: int | None = None,
    keep_process_group: bool = False,
    layout: str | Path | None = None,
    **overrides: Any,
) -> TrainResult:
    """Train a registered recipe in this process (or this launcher's process group), or on N new processes.

    Args:
        recipe_name: a name from `accel-trainer list`, or a recipe file's path (`"./my_gpt.py"`).
        config_file: optional YAML file of config values, applied before the overrides.
        num_processes: from a script or a notebook that was not launched, start this many processes (N GPUs
            when there are, gloo on the CPU otherwise) the way accelerate's `notebook_launcher` does, and
            return the main process's result. Recipes defined in the notebook work: the processes are forked.
        keep_process_group: for a script that trains several runs in one launch (a sweep, the test suite's
            scenario workers): the launcher's process group stays up for the next `train`, which then trains
            exactly as in a fresh launch (tests/layouts/test_scenario_launches.py). By default the run ends the group.
        layout: an accelerate config file or a shipped layout's name (`"cpu_fsdp"`), applied as `accelerate
            launch --config_file` would (parallel/layout_file.py): in a launched worker, to this process; else
            on the layout's processes, started as `num_processes` starts them.
        **overrides: config values, typed (`max_steps=100`) or as strings (`max_steps="100"`).

    Returns:
        The final metrics (last logged training step and last evaluation) and the run folder.

    Raises:
        UserError: for an unknown recipe, a bad config value or a layout that is not what it claims.
    """
    show_our_warnings_as_one_line()
    drop_known_import_noise()
    recipe_name = recipe_name_of(recipe_name)
    if layout is not None:  # the layout's variables for this run alone: the next run here (a sweep's) is without
        spec, launched = read_layout(str(layout)), launched_world_size()
        if launched is not None:
            check_launched_layout(spec, launched)
        elif num_processes not in (None, spec.num_processes) or spec.num_machines > 1:
            raise LayoutError(f"layout={layout}: {spec.num_processes} processes on {spec.num_machines} machine(s),"
                              f" not num_processes={num_processes} here; torchrun ... layout= on each")  # fmt: skip
        with layout_environment(spec):  # not launched: its processes, forked with its variables
            return train(recipe_name, config_file=config_file, keep_process_group=keep_process_group,
                         num_processes=num_processes if launched else spec.num_processes, **overrides)  # fmt: skip
    if num_processes is not None and num_processes != (launched_world_size() or 1):
        resolve_config(get_recipe(recipe_name).Config, config_file, overrides)  # fail here, before any process
        metrics, run_dir = launch_processes(train, recipe_name, num_processes, config_file, overrides)
        return TrainResult(metrics=metrics, run_dir=run_dir)
    with stop_signals_caught():  # from the start: a signal during the set-up stops the run at its first step
        return _train_here(recipe_name, config_file, overrides, keep_process_group=keep_process_group)


def _train_here(
    recipe_name: str, config_file: str | Path | None, overrides: dict[str, Any], *, keep_process_group: bool = False
) -> TrainResult:
    """Train in this process, or in the process group of the launcher that started it."""
    large_blocks_returned()  # before the base is read: glibc's heap would keep the activations' freed blocks
    recipe_cls = get_recipe(recipe_name)
    cfg, layout = resolve_settings(recipe_cls.Config, config_file, overrides, launch_settings_file())
    check_trackers(cfg.trackers)
    accelerator = build_accelerator(cfg, layout)
    if accelerator.is_main_process:
        for problem in config_warnings(cfg):
            warnings.warn(f"accel-trainer: {problem}", stacklevel=2)
    recipe = recipe_cls(cfg)
    new_folder, run_dir, completed = not (cfg.output_dir and Path(cfg.output_dir).exists()), None, False
    try:
        run_dir = _make_run_dir(accelerator, recipe_name, cfg)
        given = micro_batch_size_given(config_file, overrides)
        with closed_output_stops(request_stop):  # `| tee` killed by the same Ctrl-C: still a checkpoint
            metrics = train_loop(recipe, cfg, layout, accelerator, run_dir, recipe_name, given)
        completed = True
    except Preempted as stop:
        if cfg.resume != "auto":
            stop.how_to_continue = f"to continue, run it again with resume=auto output_dir={run_dir}"
        elif not cfg.output_dir:
            stop.how_to_continue = f"rerun the same command to continue it (or add output_dir={run_dir})"
        raise
    except BaseException as error:
        if run_dir is not None and new_folder and accelerator.is_main_process:
            run_folder.discard_unstarted(run_dir, refused=isinstance(error, UserError))
        raise
    finally:
        if accelerator.is_main_process:  # a run that did not complete stays the one its command continues
            run_folder.release(recipe_name, cfg, run_dir, completed)
        if keep_process_group:  # the next run builds its own Accelerator on the same group
            if completed:
                accelerator.wait_for_everyone()
            forget_accelerate_state()
    if not keep_process_group:
        accelerator.end_training()
    return TrainResult(metrics=metrics, run_dir=run_dir)


def main(recipe_name: str, argv: list[str] | None = None, program: list[str] | None = None) -> None:
    """Command-line entry for a recipe script: `[--config FILE] [--print-config] [--help] key=value ...`.

    Errors the user can fix are printed as one line (exit status 2); a crash in recipe code shows the recipe's
    frames only, once (errors.describe_crash; exit status 1); a closed stdout (`| head`) ends it without a word
    (console/closed_stdout.py; status 1). A run stopped by SIGTERM, SIGINT or SIGUSR1 saves a checkpoint and exits
    with status 75 (`EXIT_PREEMPTED`). A multi-process run ends with
    `os._exit(status)` once everything is flushed, errors included: about 1 in 20 clean 2-process gloo runs
    otherwise aborted at interpreter exit (docs/accelerate-traps.md), and so did 1 in 6 FSDP runs stopped by
    the non-finite guard ("terminate called without an active exception", SIGABRT instead of exit 2).
    """
    with stop_signals_caught():  # first: a signal at any later moment is a checkpoint, not a death
        status = _command_status(recipe_name, list(sys.argv[1:] if argv is None else argv), program or [sys.argv[0]])
        if status is None:  # --help
            return
        end_launched_worker(status)
    raise SystemExit(status)  # called in-process (tests): the caller's signal handlers are back


def _config_checked(recipe_name: str, line: CommandLine, layout: Layout) -> None:
    """The config's own refusals, its batch sizes against the layout's data-parallel ranks and eval_tasks on a
    sharding layout, said once before the layout's processes start: each would say it, seconds later."""
    cfg, settings = settings_on_layout(get_recipe(recipe_name).Config, layout, line.config_file, line.overrides)
    refuse_sharding_layout(cfg.eval_tasks, settings, layout)
    if (data_parallel := data_parallel_size_on_layout(settings, layout)) is not None:
        fit = not micro_batch_size_given(line.config_file, line.overrides)
        plan_batches(cfg.global_batch_size, planned_micro_batch_size(cfg.micro_batch_size), data_parallel, fit=fit)


def _command_status(recipe_name: str, arguments: list[str], program: list[str]) -> int | None:
    """Run the command; its exit status (None for --help), each failure said as `main` describes. `program`:
    how a launcher starts this command's workers (the script, or `-m accel_trainer train NAME`)."""
    is_rank_zero = int(os.environ.get("RANK", "0")) == 0
    show_our_warnings_as_one_line()
    drop_known_import_noise()
    try:
        recipe_name = recipe_name_of(recipe_name)  # `train ./my_gpt.py`: the recipe that file registers
        if "--help" in arguments or "-h" in arguments:  # before reading the rest: help for a command gone wrong
            _print_help(recipe_name)
            return None
        line = parse_command_line(arguments)
        checked = functools.partial(_config_checked, recipe_name, line)
        answered = launch_on_layout(line, [*program, *line.own_words], start=not line.print_config, check=checked)
        if isinstance(answered, int):
            return answered
        with layout_environment(answered) if answered else contextlib.nullcontext():  # else the launcher's layout
            if line.print_config:
                processes = f"{answered.num_processes} process(es) of {answered.path.name}" if answered else None
                _print_config(recipe_name, line, is_rank_zero, processes)
                return 0
            result = _train_here(recipe_name, line.config_file, line.overrides)
        if is_rank_zero:
            print(f"run folder: {result.run_dir}", flush=True)  # flushed where a closed stdout is caught
        status = 0
    except UserError as error:  # one write: the lines of two processes must not run into each other
        say_user_error(f"accel-trainer: error: {error}\n")
        status = 2
    except Preempted as stop:
        if is_rank_zero:
            print(f"accel-trainer: {stop}", file=sys.stderr)
        status = EXIT_PREEMPTED
    except Exception as error:  # a bug: in recipe code, show its frames, once
        if os.environ.get("ACCEL_TRAINER_FULL_TRACEBACK"):
            raise
        rank = os.environ.get("RANK", "0")
        if stdout_is_closed(error):  # `| head` has read what it wanted: stop without a word
            pass
        elif _is_lost_peer(error):
            print(
                f"accel-trainer: rank {rank}: lost another process during {where()}: it stopped (an error or a"
                " signal), died, or did not answer within collective_timeout_s; its own line says which",
                file=sys.stderr,
            )
        elif is_rank_zero:
            print(describe_crash(error), file=sys.stderr)
        else:  # the same failure on every rank would repeat the report: one line here
            print(f"accel-trainer: rank {rank}: {type(error).__name__}: {error}", file=sys.stderr)
        status = 1
    return status


def _is_lost_peer(error: BaseException) -> bool:
    """A collective that timed out, or whose peer closed the connection: another process hung or died."""
    text = str(error)
    return isinstance(error, DistBackendError) or any(
        sign in text for sign in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer")
    )


def _print_help(recipe_name: str) -> None:
    recipe_cls = get_recipe(recipe_name)
    print(f"{recipe_name}: {describe(recipe_cls)}\n")
    print("usage: [--config FILE.yaml] [--print-config] key=value | --key value | --key=value ...")
    print("       [layout=NAME|FILE [-- accelerate launch options]]: on a layout's processes (accel-trainer list)\n")
    print("config fields (what to train, the same on every layout):")
    print(describe_fields(recipe_cls.Config))
    print("\nlayout settings (how this hardware runs it; also read from <accelerate config>.settings.yaml):")
    print(describe_fields(LayoutSettings), flush=True)  # flushed where a closed stdout is caught


def _print_config(recipe_name: str, line: CommandLine, is_rank_zero: bool, processes: str | None = None) -> None:
    """`--print-config`: the values a run of this command would train with, as YAML that `--config` reads back."""
    layout_file = launch_settings_file()
    cfg, layout = resolve_settings(get_recipe(recipe_name).Config, line.config_file, line.overrides, layout_file)
    if not is_rank_zero:
        return
    sources = " < ".join(["defaults", *([str(layout_file)] if layout_file else []),
                          *([line.config_file] if line.config_file else []), "the command's overrides"])  # fmt: skip
    if processes is None:
        launched = launched_world_size()
        processes = f"{launched} processes of this launch" if launched else "1 process (not launched)"
    print(f"# {recipe_name}: what this command would train with ({sources}), on {processes}")
    if processes.endswith(".yaml"):  # a layout is the command's, not the config's: --config does not carry it
        layout_name = processes.rsplit(" of ", 1)[1]
        print(f"# (the layout is not config: give layout={layout_name} beside --config to train on it)")
    print(config_to_yaml(cfg), end="")
    print("# layout settings")
    print(layout_to_yaml(layout), end="", flush=True)


def _make_run_dir(accelerator: Any, recipe_name: str, cfg: Any) -> Path:
    """The run folder (checkpoint/run_folder.py), chosen on the main process and shared so every process uses it."""
    answer: list[str | None] = [None, None]  # the folder, or a problem
    if accelerator.is_main_process:
        try:
            run_dir = run_folder.choose(recipe_name, cfg)
            run_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=run_dir):  # writable, which root's os.access would not tell
                pass
            answer[0] = str(run_dir)
        except OSError as error:
            folder = cfg.output_dir or run_folder.OUTPUTS
            answer[1] = f"cannot write the run folder {folder}: {error.strerror}; choose another output_dir"
        except UserError as error:
            answer[1] = str(error)
    if accelerator.num_processes > 1:
        broadcast_object_list(answer)
    if answer[1]:
        raise UserError(answer[1])
    return Path(str(answer[0]))

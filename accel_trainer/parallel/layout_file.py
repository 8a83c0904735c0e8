"""`layout=NAME|FILE`: an accelerate config applied in the worker itself, so that every launcher gets the layout.

`accelerate launch --config_file F` turns F into environment variables for its workers (FSDP options, mixed
precision, the parallelism sizes, dynamo) before it starts them; torchrun, a SLURM srun, a Kubernetes job, Ray
Train or a plain `python` start workers without them, which then train with DDP at most. With `layout=F` (a
file, or a shipped layout's name: shipped.find_layout) each worker computes those variables itself with
accelerate's own launch code (`launch_command_parser`, `_validate_launch_command`, `prepare_multi_gpu_env`, the
functions `accelerate launch` runs) and sets them before its Accelerator is built, and names the file in
ACCEL_TRAINER_LAYOUT so its settings companion (`F.settings.yaml`) is read too. Under `accelerate launch` with
the same file the variables are already there; with another file that disagrees, the run is refused in one line.
Launcher options (`accelerate launch`'s own, after `--`: `--num_processes 8`, `--mixed_precision bf16`) are part
of the layout: the launcher names them to its workers in ACCEL_TRAINER_LAYOUT_OPTIONS, which read them with the
file.

Not under any launcher, `accel-trainer train NAME layout=F` (or `python recipe.py layout=F`) starts F's
processes itself with accelerate's launcher, as `accelerate launch --config_file F [options after --] ...
layout=F` would (`launch_layout`); on several machines, one such command per machine, each given its
`--machine_rank` (scripts/slurm.sbatch).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from accel_trainer.contract.shipped import find_layout
from accel_trainer.errors import LayoutError

LAYOUT_VARIABLE = "ACCEL_TRAINER_LAYOUT"
OPTIONS_VARIABLE = "ACCEL_TRAINER_LAYOUT_OPTIONS"  # the launcher options, as a JSON list
# The launcher's own business, not the layout's: threads per process, and the rendezvous it already made.
_LAUNCHER_OWNED = ("OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "MASTER_ADDR", "MASTER_PORT")
# What makes one layout another: set by a launcher's config and missing from the layout, it is a second layout.
_STEERING = ("ACCELERATE_USE_", "FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_MIXED_PRECISION")


@dataclass(frozen=True)
class Layout:
    """An accelerate config file and what `accelerate launch` would start from it."""

    path: Path
    options: tuple[str, ...]  # accelerate launch's options given beside the file
    num_processes: int
    num_machines: int
    environment: dict[str, str]  # the variables its workers get that this process does not have yet
    steering: frozenset[str]  # every variable of the kinds that steer the layout that its workers get


def read_layout(name_or_file: str, launcher_options: list[str] | None = None) -> Layout:
    """The layout `layout=` names, with `accelerate launch`'s `launcher_options` (by default those the launcher
    of this process was given), read with accelerate's launch code.

    Raises:
        ConfigError: no such file or shipped layout.
        LayoutError: accelerate cannot read the file as a launch config, or refuses the options.
    """
    path = find_layout(name_or_file).resolve()
    if launcher_options is None:
        launcher_options = json.loads(os.environ.get(OPTIONS_VARIABLE, "[]"))
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)  # its advice on values the file leaves out is for interactive launches
    refusal = io.StringIO()  # argparse's usage and complaint: its last line is the complaint
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(refusal):
            warnings.simplefilter("ignore")
            words = ["--config_file", str(path), "--main_process_port", "0", *launcher_options, "layout"]
            args, _, _ = _validate_launch_command(launch_command_parser().parse_args(words))
            _refuse_other_launchers(args, path)
            several = (args.use_fsdp or args.multi_gpu or args.use_megatron_lm) and not args.cpu
            environment = prepare_multi_gpu_env(args) if several else prepare_simple_launcher_cmd_env(args)[1]
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        AssertionError,
        OSError,
        SystemExit,
        yaml.YAMLError,
    ) as error:
        given = f" with {' '.join(launcher_options)}" if launcher_options else ""
        said = refusal.getvalue().strip().splitlines()[-1:] if isinstance(error, SystemExit) else [str(error)]
        raise LayoutError(f"layout {path}{given} is not what accelerate can launch: {''.join(said)}") from None
    finally:
        launch_logger.setLevel(level)
    added = {
        key: value
        for key, value in environment.items()
        if os.environ.get(key) != value and key not in _LAUNCHER_OWNED and key != "PYTHONPATH"
    }
    steering = frozenset(key for key in environment if key.startswith(_STEERING))
    options = tuple(launcher_options)
    return Layout(path, options, int(args.num_processes or 1), int(args.num_machines or 1), added, steering)


def _refuse_other_launchers(args: Any, path: Path) -> None:
    """DeepSpeed and TPU configs: their variables come from launchers of their own (deepspeed's, xla's), which
    layout= is not."""
    own = [name for flag, name in (("use_deepspeed", "DeepSpeed"), ("tpu", "TPU")) if getattr(args, flag, None)]
    if own:
        raise LayoutError(
            f"layout {path} is a {own[0]} config, which layout= cannot apply in the workers: launch it with"
            f" accelerate launch --config_file {path}"
        )


def apply_layout(layout: Layout, launched_processes: int | None) -> None:
    """Set the layout's variables in this worker before the Accelerator is built (for the rest of the process).

    Raises:
        LayoutError: as `check_launched_layout`.
    """
    check_launched_layout(layout, launched_processes)
    os.environ.update(_naming(layout))


def check_launched_layout(layout: Layout, launched_processes: int | None) -> None:
    """Whether the launch that started this worker can take the layout's variables.

    Raises:
        LayoutError: the launcher started another number of processes, or its accelerate config set a variable
            to another value.
    """
    if launched_processes is not None and launched_processes != layout.num_processes:
        raise LayoutError(
            f"layout={layout.path.name} is {layout.num_processes} process(es) but this launch started"
            f" {launched_processes}: start {layout.num_processes} (torchrun --nproc_per_node, srun --ntasks, ...) or"
            " choose a layout of that size"
        )
    if launched_processes is not None:
        extra = sorted(k for k in os.environ if k.startswith(_STEERING) and k not in layout.steering)
        for key in [k for k in layout.environment if k in os.environ] + extra:
            says = f"says {layout.environment[key]}" if key in layout.environment else "does not set it"
            raise LayoutError(
                f"the launcher set {key}={os.environ[key]} and layout={layout.path.name} {says}: launch with"
                f" --config_file {layout.path} or leave layout= out"
            )


@contextlib.contextmanager
def layout_environment(layout: Layout) -> Iterator[None]:
    """The layout's variables for a run that no launcher started (`at.train(layout=...)` in a notebook, whose
    forked workers inherit them), put back as they were afterwards so the next run starts clean."""
    changed = _naming(layout)
    before = {key: os.environ.get(key) for key in changed}
    os.environ.update(changed)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _naming(layout: Layout) -> dict[str, str]:
    """The layout's variables, and those that name it to the processes it starts."""
    return {**layout.environment, LAYOUT_VARIABLE: str(layout.path), OPTIONS_VARIABLE: json.dumps(layout.options)}


def launch_layout(layout: Layout, program: list[str]) -> int:
    """Run `accelerate launch --config_file <layout> <its options> <program>` in this process (accelerate's
    own launcher: torchrun's agent) and return the workers' exit status. A worker's failure is its own one-line
    error: the launcher's report of it (a ChildFailedError traceback) is not repeated. A stop signal raises
    torch's SignalException once the agent has forwarded it to the workers (who save and exit 75).

    Raises:
        LayoutError: a one-process layout (run in the process itself), a several-machine one without this
            machine's `--machine_rank`, or launcher options or a rendezvous the launcher refuses.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if layout.num_processes == 1:
        raise LayoutError(f"layout={layout.path.name} is one process: it runs in this process, not launched")
    if layout.num_machines > 1 and "--machine_rank" not in layout.options:
        raise LayoutError(
            f"layout={layout.path.name} is {layout.num_machines} machines: run the command on each, with"
            " `-- --machine_rank R --main_process_ip HOST_OF_0` (scripts/slurm.sbatch does), or torchrun on each"
        )
    args = launch_command_parser().parse_args(["--config_file", str(layout.path), *layout.options, *program])
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)
    options_before = os.environ.get(OPTIONS_VARIABLE)
    os.environ[OPTIONS_VARIABLE] = json.dumps(layout.options)  # the workers read the layout as launched
    try:
        with warnings.catch_warnings():
            # On one machine a busy main_process_port (another layout started at once) makes accelerate find a
            # free one itself and say so in five lines: the run is what was asked, so the notice is not passed on.
            warnings.filterwarnings("ignore", message=r"Port `\d+` is already in use", category=UserWarning)
            launch_command(args)
    except ChildFailedError as failed:
        status = failed.get_first_failure()[1].exitcode
        return status if status and status > 0 else 1  # a negative status: killed by a signal
    except (ValueError, ConnectionError, RuntimeError) as error:
        raise LayoutError(f"the launcher of layout={layout.path.name} refused: {error}") from None
    finally:
        elastic_log.setLevel(level)
        if options_before is None:
            os.environ.pop(OPTIONS_VARIABLE, None)
        else:
            os.environ[OPTIONS_VARIABLE] = options_before
    return 0


def layout_path_from_environment() -> Path | None:
    """The layout file a `layout=` in this process (or in the command that launched it) named."""
    value = os.environ.get(LAYOUT_VARIABLE)
    return Path(value) if value else None

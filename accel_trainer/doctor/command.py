"""`accel-trainer doctor [layout=LAYOUT] [-- LAUNCH_OPTIONS]`: is this machine ready to run LAYOUT?

Prints the environment (versions, devices, the variables that steer a launch; accelerate's own `accelerate env`
report plus accel-trainer's), then launches the layout's processes with `accelerate launch -m
accel_trainer.doctor.worker` for a few seconds and says in one line per check what passed or failed, with
the fix: the rendezvous port, the rendezvous itself, the world size against the layout's num_processes (the
silently-single-process trap, docs/accelerate-traps.md), an all-reduce, a broadcast, and where each process
placed its tensors. The verdicts on the workers' reports are in doctor/checks.py.

A several-machine layout is checked as it trains: the doctor runs on every machine with accelerate launch's
options for that machine (`-- --machine_rank R --main_process_ip HOST_OF_0`), the processes of all machines form
one group, and each machine's doctor judges its own processes and the machines in the group.

Exit status: 0 when every check passed, 1 when one failed, 2 for a layout file that is missing or not an
accelerate config (one line, like every accel-trainer user error).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract.shipped import find_layout, layouts_folder
from accel_trainer.doctor.checks import Check, judge, port_in_output
from accel_trainer.doctor.environment import environment_report
from accel_trainer.errors import ConfigError
from accel_trainer.parallel.layout_file import LAYOUT_VARIABLE
from accel_trainer.processes import free_port

DEFAULT_LAYOUT = Path("accelerate_configs") / "cpu_ddp.yaml"
"""Two processes (gloo on the CPU, or 2 GPUs): the smallest layout with a rendezvous and collectives to check."""
_OUTPUT_TAIL_LINES = 15
_NATIVE_FRAME = re.compile(r"\s*(frame #\d+: |<omitting python frames>|Exception raised from )")


def doctor(config_file: str | None = None, timeout_s: float = 60.0, launcher_options: Sequence[str] = ()) -> int:
    """Print the environment and one line per check; return the exit status (0 all passed, 1 one failed).
    `launcher_options`: accelerate launch's, for this machine of a several-machine layout.

    Raises:
        ConfigError: the layout file is missing or is not an accelerate config, launcher options accelerate
            refuses, a several-machine layout without this machine's rank; a timeout that is not positive.
    """
    if not timeout_s > 0:
        raise ConfigError(f"--timeout_s {timeout_s:g}: must be more than 0")
    path = layout_path(config_file)
    options = launch_options(launcher_options)
    layout = load_layout(path, options)
    print(environment_report(path))
    count = layout.num_processes // max(1, layout.num_machines or 1) if layout.distributed_type != "NO" else 1
    machine = f" on machine {options.machine_rank} of {layout.num_machines}" if (layout.num_machines or 1) > 1 else ""
    print(f"\nchecks: {count} process(es) of {path}{machine}, at most {timeout_s:g} s")
    if options.main_process_port or (options.machine_rank or 0) > 0:  # the options' port, or machine 0's business
        port = int(options.main_process_port or layout.main_process_port)
        where = "machine 0 holds it" if (options.machine_rank or 0) > 0 else "given after --"
        port_check, pinned = Check("ok", "port", f"{port} ({where})"), True
    else:
        port, port_check = rendezvous_port(layout, path)
        pinned = layout.main_process_port not in (None, 0)
    with tempfile.TemporaryDirectory(prefix="accel_trainer_doctor_") as scratch:
        output, timed_out = launch(path, None if pinned else port, Path(scratch), timeout_s, list(launcher_options))
        reports = [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("rank*.json"))]
    if port_check.status == "ok":
        port_check = port_in_output(output, port) or port_check
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = [port_check, *judge(layout, path, reports, timed_out, timeout_s, cuda_count)]
    for check in checks:
        print(check.line())
    failed = any(check.status == "FAIL" for check in checks)
    if failed and output.strip():
        print("\nthe launcher's last lines:\n" + "\n".join("  " + line for line in _tail(output)))
    return 1 if failed else 0


def layout_path(config_file: str | None) -> Path:
    """The layout to check: the one given; else accelerate_configs/cpu_ddp.yaml (2 processes), or gpu.yaml on a
    machine with exactly one GPU (cpu_ddp.yaml would put both processes there), here or in this checkout."""
    if config_file is not None:
        try:
            return find_layout(config_file)
        except ConfigError:
            raise ConfigError(
                f"--config_file {config_file} does not exist; pass an accelerate config or a shipped layout's name"
                f" such as {DEFAULT_LAYOUT.stem}"
            ) from None
    default = DEFAULT_LAYOUT.with_name("gpu.yaml") if torch.cuda.device_count() == 1 else DEFAULT_LAYOUT
    for folder in (Path.cwd(), layouts_folder().parent):
        if (folder / default).is_file():
            return folder / default
    return layouts_folder() / default.name  # an installed package's copy


def launch_options(words: Sequence[str]) -> Namespace:
    """accelerate launch's options, read by its own parser (unset ones are None).

    Raises:
        ConfigError: an option accelerate launch does not know, or a value it refuses.
    """
    from accelerate.commands.launch import launch_command_parser

    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):
            return launch_command_parser().parse_args([*words, "doctor"])
    except SystemExit:
        said = refusal.getvalue().strip().splitlines()[-1:]
        raise ConfigError(
            f"the options after -- ({' '.join(words)}) are not accelerate launch's: {''.join(said)}"
        ) from None


def load_layout(path: Path, options: Namespace | None = None) -> Any:
    """The layout as accelerate's launcher reads it (its `ClusterConfig`), with `options` (accelerate launch's)
    giving its size and machine count where they name them.

    Raises:
        ConfigError: not YAML, not an accelerate config (accelerate's reason in one line), or several machines
            without this machine's --machine_rank.
    """
    from accelerate.commands.config.config_args import load_config_from_file

    if not path.read_text().strip():
        raise ConfigError(
            f"{path} is empty: write an accelerate config there (`accelerate config`), or pass one"
            " such as accelerate_configs/cpu_ddp.yaml"
        )
    try:
        layout = load_config_from_file(str(path))
    except Exception as error:  # noqa: BLE001 - yaml, unknown keys, a list instead of a mapping: all one line
        raise ConfigError(f"{path} is not an accelerate config: {' '.join(str(error).split())}") from None
    for name in ("num_processes", "num_machines"):
        if options is not None and getattr(options, name) is not None:
            setattr(layout, name, getattr(options, name))
    if (layout.num_machines or 1) > 1 and (options is None or options.machine_rank is None):
        raise ConfigError(
            f"{path} spans {layout.num_machines} machines: run the doctor on each, with this machine's rank and"
            f" machine 0's address: accel-trainer doctor layout={path.stem} -- --machine_rank R --main_process_ip"
            " HOST_OF_0"
        )
    return layout


def rendezvous_port(layout: Any, path: Path) -> tuple[int, Check]:
    """The port the launch will meet on and whether it is free: the layout's main_process_port, or a free one."""
    if layout.distributed_type == "NO":
        return 0, Check("ok", "port", "one process: no rendezvous port needed")
    if layout.main_process_port in (None, 0):
        port = free_port()
        return port, Check("ok", "port", f"{path.name} pins no main_process_port; this check used free port {port}")
    port = int(layout.main_process_port)
    holder = port_holder(port)
    if holder is None:
        return port, Check("ok", "port", f"{port} (main_process_port in {path.name}) is free")
    return port, Check(
        "FAIL",
        "port",
        f"{port} (main_process_port in {path.name}) is in use{holder}: on one machine accelerate moves the launch"
        " to a random port with a warning, on several it refuses to start",
        f"set main_process_port in {path.name} to a free port ({free_port()} is free now) or to 0 (any free port),"
        " or pass --main_process_port to accelerate launch, or stop the process holding it",
    )


def port_holder(port: int) -> str | None:
    """None when `port` is free; else " (pid N, name)" where the holder can be seen, or ""."""
    from accelerate.utils.other import is_port_in_use

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for a store
        try:
            probe.bind(("", port))
            taken = is_port_in_use(port)  # accelerate's own test: something answers on localhost
        except OSError:
            taken = True
    if not taken:
        return None
    with contextlib.suppress(Exception):
        import psutil

        for connection in psutil.net_connections(kind="inet"):
            if connection.laddr and connection.laddr.port == port and connection.pid:
                return f" (pid {connection.pid}, {psutil.Process(connection.pid).name()})"
    return ""


def launch(
    path: Path, port: int | None, folder: Path, timeout_s: float, launcher_options: list[str]
) -> tuple[str, bool]:
    """Run the workers under `accelerate launch`; return the launcher's output and whether it was stopped.

    A launch still running after `timeout_s` is ended whole (the launcher, torchrun's agent and every worker).
    The workers' collectives time out a little earlier, so that a process stuck in one reports where it was.
    """
    # accelerate's launch command alone: the `accelerate` command imports all its commands, and `estimate` imports
    # transformers (docs/accelerate-traps.md). The workers are told the layout (for its settings file) as a
    # launch with layout= tells them: ACCEL_TRAINER_LAYOUT.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    command += ["--main_process_port", str(port)] if port else []
    command += launcher_options
    command += ["-m", "accel_trainer.doctor.worker", str(folder), str(0.75 * timeout_s)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAYOUT_VARIABLE: str(path.resolve())}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process:
        try:
            return process.communicate(timeout=timeout_s)[0], False
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            return process.communicate()[0], True


def _kill_tree(pid: int) -> None:
    """End the launcher and every process under it: torchrun starts each worker in a session of its own."""
    import psutil

    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        family = []
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()


def _tail(output: str) -> list[str]:
    """The last lines of the launcher's output, without the C++ stack frames torch adds to its errors."""
    lines = [line for line in output.rstrip().splitlines() if not _NATIVE_FRAME.match(line)]
    return lines[-_OUTPUT_TAIL_LINES:]

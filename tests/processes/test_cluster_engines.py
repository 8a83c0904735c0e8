"""Cluster engines start the workers, `layout=` gives them the layout (parallel/layout_file.py).

Kubernetes: the pods of deploy/kubernetes/trainjob.yaml (Kubeflow Trainer v2) and pytorchjob.yaml (the v1 training
operator), each with the variables its operator sets. Trainer's torch plugin (kubeflow/trainer's
pkg/runtime/framework/plugins/torch/torch.go) sets torchrun's PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the
Job's completion index), PET_MASTER_ADDR (`<trainjob>-node-0-0.<trainjob>`) and PET_MASTER_PORT (29500), and
nothing else; the v1 operator (training-operator's pkg/controller.v1/pytorch/envvar.go and master.go) the same PET_*
(node 0 `<job>-master-0`, port 23456) and MASTER_ADDR/PORT, WORLD_SIZE = replicas x nprocPerNode and RANK = the
pod's node rank, which torchrun sets anew in each worker's environment. torchrun makes of each pod's command and
environment the job the manifest describes, and waits for a stop's save as long as accel-trainer's own launcher,
within the pod's grace period. Run as two "nodes" on loopback (once for both: their workers see the same
environment), the pods form one job and train what one process trains.

Ray Train: deploy/ray/train_recipe.py, a local Ray with two CPU workers on layout=cpu_fsdp, trains what one
process trains; on cpu_ddp, a worker killed mid-run is restarted with its group, which continues exactly, and a
SIGTERM to one worker stops every worker at one step, saved (one Ray run for both: a Ray start costs 20-40 s).
SLURM: test_slurm.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import launches
import pytest
import torch
import yaml
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.checkpoint import files
from accel_trainer.observe.events import read_events
from accel_trainer.processes import SHUTDOWN_TIMEOUT_S
from accel_trainer.stopping.signals import EXIT_PREEMPTED, PreemptionWatcher, request_stop, stop_signals_caught
from conftest import LAUNCH_TIMEOUT_S, REPO, clean_env, final_parameters, free_port, reset_accelerate_state

PYTORCHJOB = REPO / "deploy" / "kubernetes" / "pytorchjob.yaml"
TRAINJOB = REPO / "deploy" / "kubernetes" / "trainjob.yaml"
GRACE_MARGIN_S = 30
"""Seconds of a pod's grace period after torchrun's shutdown timeout: for it to kill its workers and exit."""
TORCHRUN_SETS_FOR_EACH_WORKER = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}
"""Set anew in every worker's environment by torchrun's agent (torch/distributed/elastic/agent/server/
local_elastic_agent.py, `_start_workers`): a pod's own values of them never reach a worker."""
RAY_ENTRY = REPO / "deploy" / "ray" / "train_recipe.py"
TINY_GPT = dict(n_layer=2, d_model=32, n_head=2, block_size=32, max_steps=3, max_source_bytes=100_000,
                eval_every_steps=0, show_progress_bar=False, report=False)  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run every engine's workers must reproduce: the tiny GPT on one process."""
    folder = tmp_path_factory.mktemp("one_process")
    at.train("gpt", output_dir=str(folder), **TINY_GPT)
    reset_accelerate_state()
    return folder


def assert_weights_of_one_process(one_process, run_dir) -> None:
    expected, actual = final_parameters(one_process), final_parameters(run_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)


def container_env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def pytorchjob_pods(loopback_port: int | None = None) -> list[tuple[dict, list[str], dict[str, str]]]:
    """Each pod of deploy/kubernetes/pytorchjob.yaml by node rank: its spec, its command, and its environment, the
    manifest's and what the v1 training operator adds (a fixed-size job: no elastic policy). Node 0 is the master
    pod `<job>-master-0` on port 23456, or 127.0.0.1 on `loopback_port`."""
    job = yaml.safe_load(PYTORCHJOB.read_text())
    nproc, replicas = int(job["spec"]["nprocPerNode"]), job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(spec["replicas"] for spec in replicas.values())
    master, port = ("127.0.0.1", loopback_port) if loopback_port else (f"{job['metadata']['name']}-master-0", 23456)
    pods = []
    for replica_type, spec in replicas.items():  # Master, then Worker: node ranks 0, 1
        (container,) = spec["template"]["spec"]["containers"]
        for index in range(spec["replicas"]):
            rank = index + (1 if replica_type == "Worker" else 0)
            operator = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port),
                        "PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * nproc),
                        "RANK": str(rank), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(rank),
                        "PET_NNODES": str(nodes)}  # fmt: skip
            command = [*container["command"], *container.get("args", [])]
            pods.append((spec["template"]["spec"], command, {**container_env(container), **operator}))
    return pods


def trainjob_pods(loopback_port: int | None = None) -> list[tuple[dict, list[str], dict[str, str]]]:
    """Each pod of deploy/kubernetes/trainjob.yaml by node rank: the TrainingRuntime's pod spec, the TrainJob's
    command, and the environment of the runtime's container `node`, the TrainJob's and what Trainer's torch plugin
    adds. Node 0 is the first pod of the replicated job `node`, `<trainjob>-node-0-0.<trainjob>` on port 29500, or
    127.0.0.1 on `loopback_port`."""
    runtime, job = yaml.safe_load_all(TRAINJOB.read_text())
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "kind": runtime["kind"]}
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    assert replicated["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    spec = replicated["template"]["spec"]["template"]["spec"]
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    (container,) = [container for container in spec["containers"] if container["name"] == "node"]
    master, port = ("127.0.0.1", loopback_port) if loopback_port else (f"{name}-node-0-0.{name}", 29500)
    plugin = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
              "PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port)}  # fmt: skip
    env = {**container_env(container), **container_env(trainer), **plugin}
    command = [*trainer["command"], *trainer.get("args", [])]
    return [(spec, command, {**env, "PET_NODE_RANK": str(rank)}) for rank in range(trainer["numNodes"])]


@pytest.mark.parametrize("pods", [pytorchjob_pods, trainjob_pods], ids=["pytorchjob", "trainjob"])
def test_each_pods_torchrun_joins_the_job_and_gives_a_stop_its_save_within_the_grace_period(
    pods, tmp_path, monkeypatch
):
    """What torchrun makes of each pod's command and environment (its own argument parsing): the node count, its node
    rank, node 0's address; after a stop signal its workers get SHUTDOWN_TIMEOUT_S to save before it kills them
    (accel-trainer's own launcher's 120 s, not torch's 30 s), and the pod's grace period GRACE_MARGIN_S more."""
    from torch.distributed.run import config_from_args, parse_args

    for name in [name for name in os.environ if name.startswith(("PET_", "TORCH_ELASTIC_"))]:
        monkeypatch.delenv(name)
    nodes = pods()
    for rank, (spec, command, env) in enumerate(nodes):
        assert command[0] == "torchrun"
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config, _, _ = config_from_args(parse_args(["--log-dir", str(tmp_path), *command[1:]]))
        assert (config.min_nodes, config.max_nodes, config.rdzv_configs["rank"]) == (len(nodes), len(nodes), rank)
        assert config.rdzv_endpoint == f"{env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']}"
        assert config.shutdown_timeout == SHUTDOWN_TIMEOUT_S
        assert spec["terminationGracePeriodSeconds"] >= SHUTDOWN_TIMEOUT_S + GRACE_MARGIN_S


@pytest.mark.multiprocess
def test_the_trainjob_and_pytorchjob_pods_form_one_job_that_trains_as_one_process_does(one_process, tmp_path):
    """One launch for both manifests: their pods run one command, and a PyTorchJob pod's environment is the
    TrainJob pod's plus variables that torchrun sets anew in each worker's, so their workers see the same."""
    port, overrides = free_port(), [f"{key}={value}" for key, value in TINY_GPT.items()]
    pods = trainjob_pods(port)
    for (_, command, env), (_, v1_command, v1_env) in zip(pods, pytorchjob_pods(port), strict=True):
        assert v1_command == command and {name: v1_env.get(name) for name in env} == env
        assert v1_env.keys() - env.keys() <= TORCHRUN_SETS_FOR_EACH_WORKER | {
            "PYTHONUNBUFFERED"
        }  # =1, as the image sets
    processes = []
    for _, command, env in pods:
        assert command[0] == "torchrun"  # the image's; here this Python's
        words = [sys.executable, "-m", "torch.distributed.run", *command[1:], f"output_dir={tmp_path / 'job'}",
                 *overrides]  # fmt: skip
        processes.append(subprocess.Popen(words, env={**clean_env(), **env}, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [process.communicate(timeout=LAUNCH_TIMEOUT_S) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert "layout: 2 process(es) on cpu, DDP" in outputs[0][0]

    assert_weights_of_one_process(one_process, tmp_path / "job")


@pytest.mark.multiprocess
def test_ray_trains_workers_sharded_by_the_layout_as_one_process_trains(one_process, tmp_path):
    pytest.importorskip("ray.train")
    overrides = [f"{key}={value}" for key, value in TINY_GPT.items()]
    words = [sys.executable, str(REPO / "deploy" / "ray" / "train_recipe.py"), "gpt", "layout=cpu_fsdp",
             f"output_dir={tmp_path / 'ray'}", *overrides]  # fmt: skip
    run = subprocess.run(words, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "layout: 2 process(es) on cpu, FSDP2" in output and f"run folder: {tmp_path / 'ray'} (step 3)" in output
    assert "LOAD_CONST" not in output  # no bytecode: Ray's print patch is off (the canary below)

    assert_weights_of_one_process(one_process, tmp_path / "ray")


SURVIVING = {**TINY_GPT, "max_steps": 40, "warmup_steps": 5}  # steps for the kill and the signal to come before the end
SAVE_EVERY = 3


@pytest.fixture(scope="module")
def one_process_every_step(tmp_path_factory):
    """The uninterrupted run a restarted Ray group must continue exactly: one process, a checkpoint at every step."""
    folder = tmp_path_factory.mktemp("one_process_every_step")
    at.train("gpt", output_dir=str(folder), save_every_steps=1, keep_last=0, **SURVIVING)
    reset_accelerate_state()
    return folder


def ray_workers(driver: subprocess.Popen) -> list[int]:
    """The pids of the Ray Train workers of this driver's local cluster (they carry its launch tag)."""
    workers = []
    for pid in launches.tagged(lambda tags: driver.launch_tag in tags):  # type: ignore[attr-defined]
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if cmdline.read().startswith(b"ray::RayTrainWorker"):
                workers.append(pid)
    return sorted(workers)


def wait_for(condition, driver: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not condition():
        if driver.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"exit status {driver.returncode}\n{log.read_text(errors='replace')[-20000:]}")
        time.sleep(0.05)


def saved_after_a_restart(run_dir: Path) -> bool:
    """Whether the run folder's events say a second attempt started and saved a checkpoint."""
    events = [event["event"] for event in read_events(run_dir)]
    return "start" in events[1:] and "checkpoint" in events[events.index("start", 1) :]


@pytest.mark.multiprocess
def test_ray_restarts_a_group_whose_worker_was_killed_exactly_and_a_signal_saves_every_worker_at_one_step(
    one_process_every_step, tmp_path
):
    """One Ray run, two faults. SIGKILL to a worker once the first checkpoint is written: Ray restarts the group
    (--max_failures 1) and resume=auto continues it. Then, once the new group has saved a checkpoint of its own,
    SIGTERM to one of its workers: every worker saves at one agreed step, the run ends and the script exits 75.
    That checkpoint holds the weights and the optimizer state of the uninterrupted run at its step, bitwise (2 DDP
    processes train exactly what one does here), and it is the checkpoint Ray was told of last."""
    pytest.importorskip("ray.train")
    out, log = tmp_path / "ray", tmp_path / "ray.log"
    words = [sys.executable, str(RAY_ENTRY), "gpt", "layout=cpu_ddp", f"output_dir={out}", "--max_failures", "1",
             f"save_every_steps={SAVE_EVERY}", "keep_last=0", "collective_timeout_s=60",
             *[f"{key}={value}" for key, value in SURVIVING.items()]]  # fmt: skip
    with open(log, "w") as output:
        driver = subprocess.Popen(words, env=clean_env(), cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_for((out / "checkpoints" / files.step_folder_name(SAVE_EVERY) / files.MANIFEST).is_file, driver, log)
        first = ray_workers(driver)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: saved_after_a_restart(out), driver, log)
        second = [pid for pid in ray_workers(driver) if pid not in first]
        assert len(second) == 2  # a new group
        os.kill(second[1], signal.SIGTERM)
        driver.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        driver.kill()
    output = log.read_text(errors="replace")
    assert driver.returncode == EXIT_PREEMPTED, output[-20000:]
    (line,) = [line for line in output.splitlines() if line.startswith("accel-trainer: stopped by ")]
    step = int(line.split(" after step ")[1].split(";")[0])
    saved = files.final_folder(out, step)
    assert line.endswith(f"after step {step}; checkpoint {saved}; rerun the same command to continue")
    assert f"Ray's newest checkpoint: {saved}\n" in output and "SIGTERM received" in output

    events = read_events(out)
    resumed = [event["step"] for event in events if event["event"] == "start"]
    assert resumed[0] == 0 and SAVE_EVERY <= resumed[1] < resumed[1] + SAVE_EVERY < step  # restarted, trained on
    assert [(event["event"], event["step"]) for event in events][-2:] == [("checkpoint", step), ("preempted", step)]
    files.verify(saved)  # complete
    assert {"rng_rank0.safetensors", "rng_rank1.safetensors"} <= {path.name for path in saved.iterdir()}  # both
    assert files.recorded_step(files.complete_checkpoints(out)[-1]) == step
    for name in ("model.safetensors", "optimizer.safetensors"):
        expected = load_file(files.final_folder(one_process_every_step, step) / name)
        actual = load_file(saved / name)
        assert actual.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def ray_entry():
    """deploy/ray/train_recipe.py, a script, imported as a module."""
    spec = importlib.util.spec_from_file_location("ray_train_recipe", RAY_ENTRY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--max_failures", "-1"], "--max_failures: expected a whole number of restarts (0 or more), not '-1'"),
        (["--max_failures=x"], "--max_failures: expected a whole number of restarts (0 or more), not 'x'"),
        (["--max_failures"], "--max_failures: expected a whole number of restarts (0 or more), not ''"),
    ],
    ids=["negative", "not a number", "missing"],
)
def test_ray_refuses_a_max_failures_that_is_no_count_in_one_line(words, said):
    pytest.importorskip("ray.train")
    with pytest.raises(SystemExit, match=f"^{re.escape(said)}$"):
        ray_entry().main(["gpt", "layout=cpu_ddp", "output_dir=out", *words])


def test_ray_needs_an_output_dir_that_every_attempt_writes_to():
    pytest.importorskip("ray.train")
    with pytest.raises(SystemExit, match="^output_dir= is required on Ray"):
        ray_entry().main(["gpt", "layout=cpu_ddp", "max_steps=3"])


def test_ray_refuses_resume_none_on_a_folder_that_holds_a_run_before_ray_starts(one_process, capsys):
    """A restarted group continues whatever `resume` says (resume=none becomes auto in the workers), so the one
    attempt that resume=none refuses is said by the driver, once."""
    pytest.importorskip("ray.train")
    with pytest.raises(SystemExit) as stop:
        ray_entry().main(["gpt", "layout=cpu_ddp", f"output_dir={one_process}", "resume=none"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"accel-trainer: error: output_dir {one_process} already holds a run")


def test_a_stop_requested_from_another_thread_stops_the_run_as_a_signal_does():
    """What deploy/ray/train_recipe.py does with Ray's preemption notice, from a thread beside the training."""
    try:
        with stop_signals_caught():
            watcher = PreemptionWatcher(num_processes=1, timeout_s=60)
            assert not watcher.should_stop()
            requester = threading.Thread(target=request_stop, args=("Ray's preemption notice",))
            requester.start()
            requester.join()
            assert watcher.should_stop() and watcher.signal_name == "Ray's preemption notice"
    finally:
        with stop_signals_caught():  # installing them again forgets the request
            pass


def test_canary_ray_train_runs_the_training_function_in_a_thread():
    """Python installs signal handlers only in the main thread, so deploy/ray/train_recipe.py installs them from
    a worker callback (`StopSignalsInTheWorker`) that Ray runs in the worker's main thread. Fails the day Ray Train
    runs the training function in the main thread, and the callback can go."""
    thread_runner = pytest.importorskip("ray.train.v2._internal.execution.worker_group.thread_runner")
    threads: list[threading.Thread] = []
    runner = thread_runner.ThreadRunner()
    runner.run(lambda: threads.append(threading.current_thread()))
    while runner.is_running():
        time.sleep(0.01)
    assert threads and threads[0] is not threading.main_thread()


def test_canary_ray_trains_print_patch_logs_what_a_library_captured():
    """deploy/ray/train_recipe.py turns Ray Train's print patch off: in Ray's workers (root logger at INFO) it logs
    even the lines a library prints into a captured stdout (dill's disassembly of a map function, which
    `datasets` fingerprints). Fails the day the patch leaves captured output alone, and the setting can go."""
    patch_print = pytest.importorskip("ray.train.v2._internal.logging.patch_print")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as captured:
            patch_print.redirected_print("LOAD_CONST 1 (text)")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert captured.getvalue() == "LOAD_CONST 1 (text)\n"  # what the library captured
    assert [record.getMessage() for record in records] == ["LOAD_CONST 1 (text)"]  # logged as well: the trap


RAY_WORKER_NICENESS = """
import os, time, ray
ray.init(num_cpus=1, include_dashboard=False)
def niceness_of_ray_workers():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/stat") as stat:
                words = cmdline.read()
                if words.startswith(b"ray::IDLE") or b"workers/default_worker.py" in words:  # a worker, not an agent
                    yield int(stat.read().rsplit(")", 1)[1].split()[16])
        except OSError:
            pass
deadline = time.monotonic() + 120  # a worker starts at 0 and lowers its priority itself
while not any(found := set(niceness_of_ray_workers())) and time.monotonic() < deadline:
    time.sleep(0.2)
print(max(found, default=None))
"""


def test_canary_ray_starts_its_workers_at_niceness_15():
    """deploy/ray/train_recipe.py starts its local cluster with RAY_worker_niceness=0: at Ray's default niceness 15
    its workers starve beside any busy process and Ray Train's timeouts loop without end. Reads the niceness of
    the idle workers a local cluster prestarts (from /proc: a worker at niceness 15 on a loaded machine would take
    minutes to answer a task). Fails the day Ray starts its workers at the usual niceness, and the setting can go."""
    pytest.importorskip("ray")
    env = {key: value for key, value in clean_env().items() if key != "RAY_worker_niceness"}
    run = subprocess.run([sys.executable, "-c", RAY_WORKER_NICENESS], env=env, capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "15"

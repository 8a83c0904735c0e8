"""Cluster engines start the workers, `layout=` gives them the layout (parallel/layout_file.py).

Kubernetes: the pods of deploy/kubernetes/pytorchjob.yaml, each run with the variables the Kubeflow training
operator sets (training-operator's pkg/controller.v1/pytorch/envvar.go and master.go: MASTER_ADDR/PORT,
WORLD_SIZE = replicas x nprocPerNode, RANK = the pod's node rank, and torchrun's PET_NNODES, PET_NPROC_PER_NODE,
PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT), as two "nodes" on loopback: they form one job and train what
one process trains.

Ray Train: deploy/ray/train_recipe.py, a local Ray with two CPU workers on layout=cpu_fsdp, trains what one
process trains. SLURM: test_slurm.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

import pytest
import torch
import yaml

import accel_trainer as at
from conftest import LAUNCH_TIMEOUT_S, REPO, clean_env, final_parameters, free_port, reset_accelerate_state

MANIFEST = REPO / "deploy" / "kubernetes" / "pytorchjob.yaml"
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


def operator_environment(job: dict, replica_type: str, index: int, port: int) -> dict[str, str]:
    """What the training operator puts in a pod's environment (a fixed-size job: no elastic policy)."""
    nproc = int(job["spec"]["nprocPerNode"])
    replicas = sum(spec["replicas"] for spec in job["spec"]["pytorchReplicaSpecs"].values())
    rank = index + (1 if replica_type == "Worker" else 0)
    master = "127.0.0.1"  # the master pod's service, `<job>-master-0`, on loopback
    return {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": master, "MASTER_PORT": str(port), "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(replicas * nproc), "RANK": str(rank),
            "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(rank), "PET_NNODES": str(replicas)}  # fmt: skip


@pytest.mark.multiprocess
def test_the_pytorchjob_pods_form_one_job_that_trains_as_one_process_does(one_process, tmp_path):
    job, port = yaml.safe_load(MANIFEST.read_text()), free_port()
    overrides = [f"{key}={value}" for key, value in TINY_GPT.items()]
    pods = []
    for replica_type, spec in job["spec"]["pytorchReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        command = [*container["command"], *container.get("args", [])]
        assert command[0] == "torchrun"  # the image's; here this Python's
        for index in range(spec["replicas"]):
            words = [sys.executable, "-m", "torch.distributed.run", *command[1:], f"output_dir={tmp_path / 'job'}",
                     *overrides]  # fmt: skip
            env = {**clean_env(), **operator_environment(job, replica_type, index, port)}
            pods.append(subprocess.Popen(words, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True))  # fmt: skip
    outputs = [pod.communicate(timeout=LAUNCH_TIMEOUT_S) for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs
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

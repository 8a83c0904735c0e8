"""SLURM: scripts/slurm.sbatch on a real Slurm (Debian's slurm-wlm; .ci/run installs it), a cluster of two node
entries on this one host that the test starts (slurmctld and one slurmd per node, auth/none, on free ports).

A job is preempted as Slurm does it before a time limit (`--signal=B:USR1@120`, sent here at once with
`scancel --batch --signal=USR1`): every process saves at one step and exits 75, the script requeues the job, and
its second start resumes from that checkpoint and ends with the weights of the same run never interrupted.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, LAUNCH_TIMEOUT_S, REPO, assert_bitwise, clean_env, final_parameters, free_port, wait_for

SCRIPT = REPO / "scripts" / "slurm.sbatch"
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
TINY_GPT = ["n_layer=2", "d_model=32", "n_head=2", "block_size=32", "max_steps=60", "max_source_bytes=100000",
            "eval_every_steps=0", "log_every_steps=5", "collective_timeout_s=60", "show_progress_bar=false",
            "report=false"]  # fmt: skip

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not all(shutil.which(name) for name in DAEMONS), reason="Slurm (slurm-wlm) is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs jobs as any user only as root"),
]


def cluster_config(folder: Path) -> str:
    host, (controller, node_1, node_2) = socket.gethostname(), (free_port() for _ in range(3))
    return f"""\
ClusterName=loopback
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={controller}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_1} CPUs=2 State=UNKNOWN
NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_2} CPUs=2 State=UNKNOWN
PartitionName=main Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node cluster: the environment its commands need."""
    folder = tmp_path_factory.mktemp("slurm")
    (folder / "state").mkdir()
    (folder / "slurm.conf").write_text(cluster_config(folder))
    env = clean_env(SLURM_CONF=str(folder / "slurm.conf"), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    for daemon in (["slurmctld", "-i"], ["slurmd", "-N", "node1"], ["slurmd", "-N", "node2"]):
        subprocess.run(daemon, env=env, check=True, timeout=60)
    try:
        wait_for(lambda: _slurm(env, "sinfo", "-h", "-o", "%t") == "idle", timeout_s=60, poll_s=0.5)
        yield env
    finally:
        for pid_file in folder.glob("*.pid"):
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def _slurm(env: dict[str, str], *command: str) -> str:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60).stdout.strip()


def job_state(env: dict[str, str], job: str) -> str:
    line = _slurm(env, "scontrol", "show", "job", job)
    return line.split("JobState=")[1].split()[0] if "JobState=" in line else ""


def test_a_job_warned_of_its_time_limit_saves_requeues_and_ends_with_the_uninterrupted_weights(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = {**slurm, "MAIN_PORT": str(free_port())}
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", f"--chdir={tmp_path}", str(SCRIPT), "gpt", "layout=2node_cpu",
         f"output_dir={run_dir}", *TINY_GPT],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    log, metrics = tmp_path / f"slurm-{job}.log", run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2
             or job_state(slurm, job) not in ("PENDING", "RUNNING"), timeout_s=LAUNCH_TIMEOUT_S)  # fmt: skip
    _slurm(slurm, "scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 sends before the limit
    wait_for(lambda: job_state(slurm, job) == "PENDING" or "COMPLETED" in job_state(slurm, job), timeout_s=120)
    assert "requeued to continue" in log.read_text(), log.read_text()
    _slurm(slurm, "scontrol", "update", f"JobId={job}", "StartTime=now")  # a requeued job waits 2 minutes
    wait_for(lambda: job_state(slurm, job) not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"),
             timeout_s=LAUNCH_TIMEOUT_S, poll_s=0.5)  # fmt: skip
    output = log.read_text()
    assert job_state(slurm, job) == "COMPLETED", output

    # Every node's processes get the signal; the main process names it, or, when another process had it at the
    # step they agreed on to stop and the main one only during that step's save, says it came to another process.
    stopped_by = re.compile(r"stopped by (SIGUSR1|a signal to another process) after step")
    stopped = [line for line in output.splitlines() if stopped_by.search(line)]
    assert len(stopped) == 1, output
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert "(start 2): 2 node(s) x 1 process(es)" in output
    assert f"resuming from {run_dir / 'checkpoints'}/step_{step:08d} at step {step}" in output, output
    reference = tmp_path / "uninterrupted"
    subprocess.run([str(BIN / "accel-trainer"), "train", "gpt", "layout=cpu_ddp", f"output_dir={reference}",
                    *TINY_GPT], env=clean_env(), cwd=tmp_path, check=True, capture_output=True,
                   timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    assert_bitwise(final_parameters(reference), final_parameters(run_dir))

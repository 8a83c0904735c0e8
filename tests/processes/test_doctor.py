"""Specification of `accel-trainer doctor`: it launches a layout's processes and names what is wrong, one line
per check (accel_trainer/doctor/command.py). The launches are real (gloo on the CPU), each a few seconds."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from accel_trainer import cli
from accel_trainer.doctor.checks import port_in_output
from conftest import LAUNCH_TIMEOUT_S, REPO, clean_env, free_port, run_command

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"


def doctor(config_file, *arguments: str):
    """The installed command, as a user runs it, with room for a launch on a loaded machine; a shipped layout by
    its name as `layout=NAME`, any other file by `--config_file`."""
    named = config_file.parent == CPU_DDP.parent
    layout = [f"layout={config_file.stem}"] if named else ["--config_file", config_file]
    command = [sys.executable, "-m", "accel_trainer", "doctor", *layout, "--timeout_s", "120"]
    return run_command([*command, *arguments], env=clean_env(), check=False)


def check_lines(output: str) -> dict[str, str]:
    """The verdict lines by check name: `ok   rendezvous: ...` -> {"rendezvous": "ok   rendezvous: ..."}."""
    lines = [line for line in output.splitlines() if line.startswith(("ok   ", "FAIL ", "skip "))]
    return {line[5:].split(":")[0]: line for line in lines}


@pytest.mark.multiprocess
def test_doctor_passes_on_the_two_process_cpu_layout_and_names_each_check():
    result = doctor(CPU_DDP)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "accelerate 1.15" in result.stdout and "torch 2.13" in result.stdout  # the environment comes first
    checks = check_lines(result.stdout)
    assert list(checks) == ["port", "rendezvous", "world size", "all-reduce", "broadcast", "devices"]
    assert all(line.startswith("ok   ") for line in checks.values()), result.stdout
    assert checks["rendezvous"].startswith("ok   rendezvous: 2 of 2 processes joined (gloo, 127.0.0.1:")
    assert "every process sees a world of 2" in checks["world size"]
    assert "the sum of rank+1 is 3 on all 2 processes" in checks["all-reduce"]
    assert "process 0 cpu" in checks["devices"] and "process 1 cpu" in checks["devices"]


@pytest.mark.multiprocess
def test_a_taken_port_that_the_layout_pins_fails_with_one_line_naming_the_port_and_the_fix(tmp_path):
    layout = tmp_path / "pinned.yaml"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        layout.write_text(CPU_DDP.read_text() + f"main_process_port: {port}\n")

        result = doctor(layout)

    assert result.returncode == 1, result.stdout + result.stderr
    port_line = check_lines(result.stdout)["port"]
    assert port_line.startswith(f"FAIL port: {port} (main_process_port in pinned.yaml) is in use")
    assert "fix: set main_process_port in pinned.yaml to a free port" in port_line
    # accelerate moved this one-machine launch to another port, where the processes still formed their group
    rendezvous = check_lines(result.stdout)["rendezvous"]
    assert rendezvous.startswith("ok   rendezvous: 2 of 2 processes joined") and f":{port})" not in rendezvous


def test_the_launchers_own_address_in_use_failure_is_named_as_the_port_fault():
    output = "DistNetworkError: The server socket has failed to listen on any local network address. port: 29611,"
    output += " useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
    check = port_in_output(output, 29611)
    assert check is not None and check.line().startswith("FAIL port: 29611 is in use; the launcher says: ")
    assert "fix: " in check.line()
    assert port_in_output("ok\nall good\n", 29611) is None


@pytest.mark.multiprocess
def test_a_multi_cpu_layout_that_starts_one_process_fails_at_the_rendezvous_with_the_frameworks_refusal(tmp_path):
    layout = tmp_path / "multi_cpu.yaml"  # accelerate's CPU launcher starts one process without mpirun
    layout.write_text(CPU_DDP.read_text().replace("distributed_type: MULTI_GPU", "distributed_type: MULTI_CPU"))

    result = doctor(layout)

    assert result.returncode == 1, result.stdout + result.stderr
    checks = check_lines(result.stdout)
    assert checks["rendezvous"].startswith("FAIL rendezvous: 1 of 2 processes could not set up the layout")
    assert "(or a MULTI_CPU config) with several processes starts only one process" in checks["rendezvous"]
    assert "launch with --config_file accelerate_configs/cpu_ddp.yaml" in checks["rendezvous"]
    assert checks["world size"].startswith("skip world size")
    assert checks["all-reduce"].startswith("skip all-reduce")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        ("distributed_type: [MULTI_GPU\n", "is not an accelerate config: while parsing"),
        ("distributed_type: MULTI_GPU\nnum_procesess: 2\n", "unknown keys (['num_procesess'])"),
        ("\n", "is empty: write an accelerate config there"),
    ],
    ids=["missing", "malformed", "unknown-key", "empty"],
)
def test_a_bad_config_file_is_a_one_line_error_with_exit_status_2(capsys, tmp_path, content, expected):
    layout = tmp_path / "layout.yaml"
    if content is not None:
        layout.write_text(content)

    with pytest.raises(SystemExit) as caught:
        cli.main(["doctor", "--config_file", str(layout)])

    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("accel-trainer: error: ") and expected in err


@pytest.mark.multiprocess
def test_a_two_machine_layout_is_checked_by_a_doctor_on_each_machine_that_sees_both_in_one_group():
    port = str(free_port())
    command = [sys.executable, "-m", "accel_trainer", "doctor", "layout=2node_cpu", "--timeout_s", "120", "--",
               "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--machine_rank"]  # fmt: skip
    machines = [subprocess.Popen([*command, str(rank)], env=clean_env(), stdout=subprocess.PIPE, text=True)
                for rank in (0, 1)]  # fmt: skip
    outputs = [machine.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for machine in machines]

    assert [machine.returncode for machine in machines] == [0, 0], outputs
    for rank, output in enumerate(outputs):
        checks = check_lines(output)
        assert f"2node_cpu.yaml on machine {rank} of 2" in output
        assert list(checks) == ["port", "rendezvous", "world size", "all-reduce", "broadcast", "machines", "devices"]
        assert all(line.startswith("ok   ") for line in checks.values()), output
        assert "1 of 1 processes joined on this machine (2 on all)" in checks["rendezvous"]
        assert "2 of 2 machines in the group: machine 0 (" in checks["machines"] and "machine 1 (" in checks["machines"]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ([], "spans 2 machines: run the doctor on each, with this machine's rank and machine 0's address"),
        (["--", "--machine_rnak", "1"], "are not accelerate launch's: "),
    ],
    ids=["no-machine-rank", "unknown-option"],
)
def test_a_two_machine_layout_without_this_machines_rank_is_a_one_line_error(capsys, options, expected):
    with pytest.raises(SystemExit) as caught:
        cli.main(["doctor", "layout=2node_cpu", *options])

    err = capsys.readouterr().err
    assert caught.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err

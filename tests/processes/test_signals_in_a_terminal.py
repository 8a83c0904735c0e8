"""A person's Ctrl-C in a real terminal (tmux) stops `at.train(recipe, num_processes=2)` with a checkpoint.

The workers of `at.train(num_processes=N)` are forked into the terminal's foreground process group: a Ctrl-C
reaches each of them directly and again, a millisecond later, through the launcher (processes.py). The first
press saves at one agreed step and the script gets `Preempted` (signalled_run.py exits 75 on it); the same
command continues exactly; a second press 1.5 s later quits at once, leaving the last checkpoint intact.
Skipped where tmux is not installed (`apt-get install tmux`).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from accel_trainer.stopping.signals import EXIT_PREEMPTED
from conftest import (
    BIN,
    REPO,
    SIGNALLED,
    SLOW_STEP,
    TEST_OVERRIDES,
    WORKERS,
    clean_env,
    final_parameters,
    logged_steps,
    wait_for,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


class Terminal:
    """An interactive bash in a detached tmux session of its own server: what a person types into."""

    def __init__(self, folder: Path):
        self.tmux = ["tmux", "-L", f"accel-test-{folder.name}-{time.monotonic_ns()}"]
        subprocess.run([*self.tmux, "new-session", "-d", "-x", "200", "-y", "50", "bash --norc --noprofile -i"],
                       env=clean_env(), check=True)  # fmt: skip

    def type(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], check=False)


def run_in_terminal(terminal: Terminal, folder: Path, run_dir: Path, **slow: str) -> Path:
    """Type the command that trains mlp_slow with at.train(num_processes=2); its output goes to a file."""
    output = folder / "output.txt"
    command = [str(BIN / "python"), str(WORKERS / "signalled_run.py"), "--notebook", "2", "mlp_slow", *SIGNALLED,
               f"output_dir={run_dir}", *TEST_OVERRIDES]  # fmt: skip
    variables = " ".join(f"{name}={value}" for name, value in {"OMP_NUM_THREADS": "1", **slow}.items())
    script = folder / "run.sh"
    # The script's shell outlives a Ctrl-C (a trap, which its child does not inherit) to write the exit status.
    script.write_text(f"trap true INT\ncd {shlex.quote(str(REPO))}\n"
                      f"{variables} {shlex.join(command)} > {output} 2>&1\necho EXIT=$? >> {output}\n")  # fmt: skip
    terminal.type(f"bash {script}", "Enter")  # the terminal's foreground job, as when a person runs it
    return output


def ended(output: Path) -> bool:
    return output.exists() and "EXIT=" in output.read_text()


def exit_status(output: Path, timeout_s: float = 180) -> int:
    wait_for(lambda: ended(output), timeout_s=timeout_s, poll_s=0.1)
    return int(output.read_text().split("EXIT=")[-1].split()[0])


def test_ctrl_c_in_a_terminal_saves_once_and_the_same_command_continues_exactly(tmp_path):
    run_dir = tmp_path / "run"
    terminal = Terminal(tmp_path)
    try:
        output = run_in_terminal(terminal, tmp_path, run_dir, **SLOW_STEP)
        wait_for(lambda: logged_steps(run_dir) >= 3 or ended(output))
        terminal.type("C-c")
        status = exit_status(output)
    finally:
        terminal.close()

    text = output.read_text()
    assert status == EXIT_PREEMPTED, text
    assert "caller got Preempted: stopped by SIGINT after step" in text and "lost another process" not in text, text
    assert "with the launcher's error chained: False" in text, text  # its traceback would be 40 lines of torch
    stopped_at = int(text.split("after step ")[1].split(";")[0])
    [saved] = files.complete_checkpoints(run_dir)
    assert files.recorded_step(saved) == stopped_at
    files.verify(saved)

    for folder in (run_dir, tmp_path / "uninterrupted"):  # the same command (resume=auto), and a reference run
        subprocess.run([str(BIN / "python"), str(WORKERS / "signalled_run.py"), "--notebook", "2", "mlp_slow",
                        *SIGNALLED, f"output_dir={folder}", *TEST_OVERRIDES],
                       cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)  # fmt: skip
    expected, resumed = final_parameters(tmp_path / "uninterrupted"), final_parameters(run_dir)
    assert all((resumed[name] == expected[name]).all() for name in expected)


def test_a_second_ctrl_c_in_a_terminal_quits_at_once_and_leaves_the_last_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"
    terminal = Terminal(tmp_path)
    try:  # each save takes 6 s: the second press comes while the stop's save runs
        output = run_in_terminal(terminal, tmp_path, run_dir, **SLOW_STEP, ACCEL_TEST_SLOW_SAVE_S="6")
        wait_for(lambda: logged_steps(run_dir) >= 12 or ended(output))
        terminal.type("C-c")
        time.sleep(1.5)
        terminal.type("C-c")
        second = time.monotonic()
        status = exit_status(output)
        quit_s = time.monotonic() - second
    finally:
        terminal.close()

    text = output.read_text()
    assert status not in (0, EXIT_PREEMPTED) and "KeyboardInterrupt" in text, text
    assert quit_s < 10, text
    [saved] = files.complete_checkpoints(run_dir)  # the step-10 checkpoint, and no other
    assert files.recorded_step(saved) == 10
    files.verify(saved)

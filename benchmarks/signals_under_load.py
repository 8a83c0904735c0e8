"""Stop signals under load: does every signalled 2-process run save once, at one agreed step?

    .venv/bin/python benchmarks/signals_under_load.py --trials 6             # this checkout
    .venv/bin/python benchmarks/signals_under_load.py --trials 6 --code DIR  # another checkout (e.g. a worktree
                                                                             # of an older commit)

Not part of `make bench` (it measures correctness under stress, not speed; about 40 s a trial). Each trial
starts two busy-loop processes (the machine's two cores are taken), then a 2-process run of the gpt recipe
streaming its corpus with the default save_every_steps=0 (a stop's checkpoint is the only one), under torchrun
or accelerate launch in turn. Once the run has logged a few steps it sends SIGINT or SIGTERM (in turn) to the
launcher and to every worker, in a random order with a random gap of 0-5 ms, as a scheduler that signals every
task does, or a terminal's Ctrl-C with a launcher forwarding its copy. A trial passes when the main process
reports one "stopped by" line and exactly one complete checkpoint holds that step (the workers exit 75; a
signalled torchrun or accelerate launch itself then exits 1, whatever its workers did).

It reproduced issue 21's losses (2026-11-25, 8 trials each): before the fix 4/8 saved, every torchrun trial
lost the run with no checkpoint (the handler restored the previous one on the first signal, so torchrun's
forwarded copy killed the worker, or one rank "lost another process"); after it, 8/8.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RUN = ["gpt", "streaming=true", "max_steps=2000", "log_every_steps=1", "eval_every_steps=0",
       "show_progress_bar=false"]  # fmt: skip


def launcher_command(kind: str, port: int) -> list[str]:
    if kind == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", "2", f"--master_port={port}", "-m", "accel_trainer",
                "train"]  # fmt: skip
    return [str(BIN / "accelerate"), "launch", "--quiet", "--config_file",
            str(REPO / "accelerate_configs/cpu_ddp.yaml"), "--main_process_port", str(port), "-m", "accel_trainer",
            "train"]  # fmt: skip


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)


def trial(index: int, code: Path, folder: Path, rng: random.Random) -> tuple[bool, str]:
    kind = ("torchrun", "accelerate")[index % 2]
    signum = (signal.SIGINT, signal.SIGTERM)[(index // 2) % 2]
    run_dir = folder / f"run{index}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    launcher = subprocess.Popen([*launcher_command(kind, 29000 + rng.randrange(2000)), *RUN,
                                 f"output_dir={run_dir}"], cwd=code, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < rng.randrange(3, 12) and launcher.poll() is None:
            if time.monotonic() > deadline:
                return False, f"{kind}: no steps within 300 s"
            time.sleep(0.05)
        targets = [launcher.pid, *children(launcher.pid)]
        rng.shuffle(targets)
        for pid in targets:
            os.kill(pid, signum)
            time.sleep(rng.uniform(0, 0.005))
        output = launcher.communicate(timeout=300)[0]
    finally:
        for process in busy:
            process.kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    stops = [line for line in output.splitlines() if "stopped by" in line]
    saved = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "manifest.json").exists())
    steps = [json.loads((p / "train_state.json").read_text())["step"] for p in saved]
    recorded = int(stops[0].split("after step ")[1].split(";")[0]) if len(stops) == 1 else None
    ok = recorded is not None and steps == [recorded] and "lost another process" not in output
    what = f"{kind} {signal.Signals(signum).name} to {len(targets)} processes: exit {launcher.returncode}, " \
           f"stop lines {len(stops)}, checkpoints at {steps or 'none'}"  # fmt: skip
    if not ok:
        what += "\n    " + "\n    ".join(line for line in output.splitlines() if "accel-trainer" in line)
    return ok, what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose accel_trainer runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    passed = 0
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.trials):
            ok, what = trial(index, args.code.resolve(), Path(folder), rng)
            passed += ok
            print(f"trial {index + 1}: {'saved' if ok else 'LOST'}: {what}", flush=True)
    print(f"{passed}/{args.trials} signalled runs saved once, at the step every process agreed on")


if __name__ == "__main__":
    main()

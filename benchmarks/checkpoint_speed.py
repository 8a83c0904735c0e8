"""Checkpoint save and load throughput against the disk's raw write speed, and training time lost per save.

    make bench      # runs this after overhead.py; about a minute

1. Raw disk: `dd if=/dev/zero bs=1M count=N conv=fsync` into the output folder, the ceiling for any save.
2. A model of about 50M parameters (200 MB) with AdamW state (400 MB more) on one CPU process: the time of
   `accel_trainer.checkpoint.save.save` (write, fsync, sha256 manifest, rename) and of `restore` (verify, load),
   as MB/s of checkpoint bytes and as a fraction of the raw disk speed.
3. Training time lost per save: a synchronous save blocks training for its whole duration; with
   `async_save=true` training waits only for the snapshot in host memory while a background thread writes.
   Both are printed, with the share of a run they cost at a given cadence of 1-second steps.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_trainer.checkpoint import save
from accel_trainer.checkpoint.restore import restore
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.checkpoint.writer import BackgroundWriter
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.optim.optimizers import Optimizers, Phase
from accel_trainer.optim.schedules import build_scheduler


def raw_disk_mb_per_s(folder: Path, megabytes: int = 512) -> float:
    result = subprocess.run(
        ["dd", "if=/dev/zero", f"of={folder / 'dd.bin'}", "bs=1M", f"count={megabytes}", "conv=fsync"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (folder / "dd.bin").unlink()
    seconds = float(re.search(r"([\d.]+) s,", result.stderr).group(1))
    return megabytes / seconds


def folder_megabytes(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        run_dir = Path(scratch)
        disk = raw_disk_mb_per_s(run_dir)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])  # 50M parameters
        optimizer = torch.optim.AdamW(model.parameters())
        cfg = TrainConfig(max_steps=100)
        scheduler = build_scheduler(optimizer, cfg)
        model, optimizer = accelerator.prepare(model, optimizer)
        model(torch.randn(4, 2048)).sum().backward()
        optimizer.step()  # creates the AdamW state, as in a real run
        trained = Trained(model, Optimizers((Phase(None, optimizer, scheduler),)))
        identity = RunIdentity("bench", cfg, LayoutSettings())

        saves, loads, blocked = [], [], []
        writer = BackgroundWriter()
        for step in (1, 2, 3):
            started = time.perf_counter()
            folder = save.save(accelerator, run_dir, TrainState(step=step).state_dict(), trained, identity)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            restore(accelerator, folder, trained, identity)
            loads.append(time.perf_counter() - started)
            started = time.perf_counter()
            save.save(accelerator, run_dir, TrainState(step=10 + step).state_dict(), trained, identity, writer=writer)
            blocked.append(time.perf_counter() - started)
            writer.wait()
        size = folder_megabytes(folder)
        save_s, load_s, blocked_s = sorted(saves)[1], sorted(loads)[1], sorted(blocked)[1]  # medians of 3
        print(f"raw disk write (dd, fsync):  {disk:8.0f} MB/s")
        print(f"checkpoint size:             {size:8.0f} MB (50M parameters + AdamW state)")
        print(f"save: {save_s:6.2f} s  {size / save_s:8.0f} MB/s  = {size / save_s / disk:.2f} of raw disk speed")
        print(f"load: {load_s:6.2f} s  {size / load_s:8.0f} MB/s  (verify checksums + load)")
        print(f"async save: training blocked {blocked_s:.2f} s (snapshot), the write goes on in the background:"
              f" {blocked_s / save_s:.1%} of a synchronous save (target: under 10%)")  # fmt: skip
        for every in (100, 1000):
            lost, lost_async = save_s / (save_s + every), blocked_s / (blocked_s + every)
            print(f"training time lost saving every {every} steps of 1 s: {lost:.2%} sync, {lost_async:.2%} async")


if __name__ == "__main__":
    main()

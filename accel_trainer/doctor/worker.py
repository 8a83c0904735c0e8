"""The processes `accel-trainer doctor` launches: join the group the framework's way, run two collectives.

    accelerate launch --config_file LAYOUT -m accel_trainer.doctor.worker REPORT_FOLDER TIMEOUT_S

Each process writes `rank<R>.json` into REPORT_FOLDER twice: once on start (so that the doctor can tell a
process that never started from one that never joined), and once with the result of each check. The Accelerator
is built by `distributed.build_accelerator` with the layout's settings file, exactly as a training run builds
it, so the launch fixes and refusals of parallel/launch_fixes.py apply here too. The doctor (doctor/command.py)
judges the reports; a worker only measures.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

BROADCAST_VALUES = [7.0, -1.5, 42.0, 3.25]
"""What rank 0 broadcasts; every process compares what it received with these."""


def main(argv: list[str] | None = None) -> None:
    """Join, run the checks, write this process's report, and leave without interpreter teardown."""
    folder, timeout_s = (sys.argv[1:] if argv is None else argv)[:2]
    rank = int(os.environ.get("RANK", "0"))
    report: dict[str, Any] = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    _write(Path(folder), rank, report)
    accelerator = _rendezvous(report, float(timeout_s))
    if accelerator is not None:
        report["all_reduce"] = _timed(_all_reduce, accelerator)
        report["broadcast"] = _timed(_broadcast, accelerator)
        report["machines"] = _timed(_machines, accelerator)
    _write(Path(folder), rank, report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a clean gloo run can abort at interpreter exit (docs/accelerate-traps.md)


def _rendezvous(report: dict[str, Any], timeout_s: float) -> Any:
    """Build the Accelerator as a run does; record the world this process sees, or why it could not join."""
    from accelerate.state import PartialState

    from accel_trainer.config.train_config import TrainConfig, resolve_settings
    from accel_trainer.errors import UserError
    from accel_trainer.parallel.accelerator import build_accelerator, launch_settings_file

    start = time.perf_counter()
    try:
        cfg, layout = resolve_settings(TrainConfig, None, {"collective_timeout_s": timeout_s}, launch_settings_file())
        accelerator = build_accelerator(cfg, layout)
    except Exception as error:  # noqa: BLE001 - reported as this check's failure
        world = PartialState().num_processes if PartialState._shared_state else None  # seen before a refusal
        text = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        failure = {"ok": False, "error": " ".join(text.split()), "user_error": isinstance(error, UserError)}
        report.update(world_size=world, rendezvous=failure)
        return None
    from accel_trainer.parallel.mesh import describe_mesh

    group = torch.distributed.is_initialized()
    report.update(
        world_size=accelerator.num_processes,
        process_index=accelerator.process_index,
        local_process_index=accelerator.local_process_index,
        device=str(accelerator.device),
        distributed_type=accelerator.distributed_type.value,
        mesh=describe_mesh(accelerator),
        backend=torch.distributed.get_backend() if group else None,
        address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if group else None,
        rendezvous={"ok": True, "seconds": time.perf_counter() - start},
    )
    return accelerator


def _all_reduce(accelerator: Any) -> dict[str, Any]:
    """The sum over the processes of rank + 1, which must be N(N+1)/2 on every process."""
    from accelerate.utils import reduce

    mine = torch.tensor([accelerator.process_index + 1.0], device=accelerator.device)
    total = reduce(mine, reduction="sum").item()
    expected = accelerator.num_processes * (accelerator.num_processes + 1) / 2
    return {"ok": total == expected, "value": total, "expected": expected}


def _broadcast(accelerator: Any) -> dict[str, Any]:
    """Rank 0's tensor, which must arrive unchanged on every process (the others start from zeros)."""
    from accelerate.utils import broadcast

    values = BROADCAST_VALUES if accelerator.process_index == 0 else [0.0] * len(BROADCAST_VALUES)
    received = broadcast(torch.tensor(values, device=accelerator.device), from_process=0).tolist()
    return {"ok": received == BROADCAST_VALUES, "value": received}


def _machines(accelerator: Any) -> dict[str, Any]:
    """Every process's machine (the launcher's node rank, GROUP_RANK) and host, gathered from the whole group."""
    from accelerate.utils import gather_object

    mine = [[int(os.environ.get("GROUP_RANK", "0")), socket.gethostname(), accelerator.process_index]]
    return {"ok": True, "value": gather_object(mine)}


def _timed(check: Any, accelerator: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = check(accelerator)
    except Exception as error:  # noqa: BLE001 - reported as this check's failure
        result = {"ok": False, "error": " ".join(f"{type(error).__name__}: {error}".split())}
    return {**result, "seconds": time.perf_counter() - start}


def _write(folder: Path, rank: int, report: dict[str, Any]) -> None:
    """Write atomically, so that the doctor never reads half a report."""
    partial = folder / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(report))
    partial.replace(folder / f"rank{rank}.json")


if __name__ == "__main__":
    main()

"""`events.jsonl`: what happened to a run and when, for the time breakdown ("goodput") of its report.

One JSON object per line, written by the main process and flushed at once: `start` (with the step it
resumed from and the seconds its setup took: data, model, checkpoint), `eval` and `checkpoint` (with their
seconds), `preempted` and `end`. Time spent training is what is left of each attempt's wall time; time
lost to restarts is the wall time of steps trained again after a resume plus the gaps between attempts
(less the next attempt's setup). The imports before setup are not counted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events to `<run>/events.jsonl` on the main process; a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / "events.jsonl" if enabled else None

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def time_breakdown(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds spent in all, setting up (data, model, checkpoint: before each `start`), evaluating,
    checkpointing, writing the final weights (a LoRA merge and a whole model), between attempts, and training
    (the rest)."""
    attempts: list[list[dict[str, Any]]] = []
    for event in events:
        if event["event"] == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(event)
    setups = [attempt[0].get("setup_s", 0.0) for attempt in attempts]  # a later one is part of a gap
    wall = sum(attempt[-1]["time"] - attempt[0]["time"] for attempt in attempts)
    gaps = sum(later[0]["time"] - earlier[-1]["time"] for earlier, later in zip(attempts, attempts[1:], strict=False))
    evaluating = sum(e.get("seconds", 0.0) for e in events if e["event"] == "eval")
    saving = sum(e.get("seconds", 0.0) for e in events if e["event"] == "checkpoint")
    final = sum(e.get("seconds", 0.0) for e in events if e["event"] == "final")
    return {
        "wall": wall + gaps + (setups[0] if setups else 0.0),
        "setup": sum(setups),
        "evaluating": evaluating,
        "checkpointing": saving,
        "final_weights": final,
        "between_attempts": max(gaps - sum(setups[1:]), 0.0),
        "training": max(wall - evaluating - saving - final, 0.0),
        "attempts": float(len(attempts)),
    }

"""Every random stream a process draws from (Python, NumPy, torch, CUDA), captured and restored exactly.

Saved per process in a checkpoint (`rng_rank<r>.safetensors`, through state_files: no pickle); the loop's data
path restores them at the moment the uninterrupted run was at (data.micro_batches).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def apply_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def rng_file_name(process_index: int) -> str:
    return f"rng_rank{process_index}.safetensors"


def capture_rng_states() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Every random stream as it was before the block, for work beside training whose draws must not move
    training's: an evaluation (its loader draws a seed when it starts, a recipe may sample), FLOP counting
    (building a model draws its initial weights). Without it, training with dropout would depend on
    eval_every_steps, and a run extended past its end (which evaluated) would not continue as an uninterrupted
    run does."""
    states = capture_rng_states()
    try:
        yield
    finally:
        apply_rng_states(states)

"""A rollout that feeds several optimizer steps: a recipe's `rollout_schedule` (TRL's `steps_per_generation` and
`num_iterations`), its micro-batches kept between the steps they feed and in the checkpoints written among them.

With `steps_per_generation` S and `num_iterations` μ, the loop runs the rollout at steps 1, 1 + Sμ, 1 + 2Sμ, ...
on S optimizer steps' micro-batches (this process's, read from the data then), and step `s` of a generation trains
on its share `(s - first) % S`: every share once, then again, μ passes in all, the weights moving at each step
(so a recipe computes the sampling weights' log-probabilities in its rollout: TRL's old_per_token_logps). The
data advance a generation at a time: after `step` optimizer steps, `data_steps(step)` steps' worth were read,
which is where a resume's data continue from. A checkpoint written inside a generation holds this process's
kept micro-batches (`rollout_rank<r>.safetensors`, no pickle: checkpoint/state_files.py), so a resume continues
the generation bitwise instead of sampling it again from other weights; on another number of processes, where
the shares would not be this process's, it is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_trainer.checkpoint import state_files
from accel_trainer.errors import ConfigError

Made = list[tuple[int, Any]]  # (epoch, micro-batch) pairs, as the loop reads them


def generation_file_name(process_index: int) -> str:
    return f"rollout_rank{process_index}.safetensors"


@dataclass
class Generations:
    """The current generation of a recipe whose rollout feeds `steps_per_generation` steps `num_iterations` times."""

    steps_per_generation: int
    num_iterations: int
    accumulation_steps: int
    made: Made | None = None  # the current generation's micro-batches, once rolled out or restored

    @property
    def every(self) -> int:
        """Optimizer steps between two rollouts."""
        return self.steps_per_generation * self.num_iterations

    def data_steps(self, step: int) -> int:
        """Optimizer steps' worth of data read after `step` optimizer steps (a generation reads all its steps' data
        at its first step)."""
        return -(-step // self.every) * self.steps_per_generation

    def micro_batches(self, step: int, fetch: Callable[[int], Made], roll: Callable[[Made], Made]) -> Iterator[Any]:
        """Step `step`'s micro-batches: its share of the generation, which `roll` makes of `fetch(n)`'s `n`
        micro-batches at the generation's first step."""
        index = (step - 1) % self.every
        if index == 0:
            self.made = roll(fetch(self.steps_per_generation * self.accumulation_steps))
        assert self.made is not None, "a resume inside a generation restores it"  # restore_generation's
        start = index % self.steps_per_generation * self.accumulation_steps
        return iter(self.made[start : start + self.accumulation_steps])

    def inside(self, step: int) -> bool:
        """Whether steps of the generation step `step` trained in are still to come."""
        return step % self.every != 0

    def save(self, folder: Path, process_index: int, step: int) -> None:
        """This process's micro-batches of the generation, where a checkpoint of `step` falls inside it."""
        if self.made is not None and self.inside(step):
            state_files.save({"made": self.made}, folder / generation_file_name(process_index))

    def restore(self, folder: Path, process_index: int, step: int, world_size: tuple[int, int]) -> None:
        """The generation a checkpoint of `step` was written inside, `world_size` (saved, now) agreeing.

        Raises:
            ConfigError: the checkpoint was written inside a generation on another number of processes.
        """
        if not self.inside(step):
            return
        saved, now = world_size
        path = folder / generation_file_name(process_index)
        if saved != now or not path.is_file():
            first = step - (step - 1) % self.every - 1
            raise ConfigError(
                f"checkpoint {folder.name} was written inside a rollout's generation (steps {first + 1}-"
                f"{first + self.every}) on {saved} process(es): resume it on {saved}, or from a checkpoint at a"
                f" multiple of steps_per_generation x num_iterations = {self.every} (save_every_steps)"
            )
        self.made = [(int(epoch), batch) for epoch, batch in state_files.load(path)["made"]]

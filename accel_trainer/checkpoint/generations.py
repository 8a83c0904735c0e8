"""A rollout that feeds several optimizer steps: a recipe's `rollout_schedule` (TRL's `steps_per_generation` and
`num_iterations`), its micro-batches kept between the steps they feed and in the checkpoints written among them.

With `steps_per_generation` S and `num_iterations` μ, the loop runs the rollout at steps 1, 1 + Sμ, 1 + 2Sμ, ...
on S optimizer steps' micro-batches (this process's, read from the data then), and step `s` of a generation trains
on its share `(s - first) % S`: every share once, then again, μ passes in all, the weights moving at each step
(so a recipe computes the sampling weights' log-probabilities in its rollout: TRL's old_per_token_logps). The
data advance a generation at a time: after `step` optimizer steps, `data_steps(step)` steps' worth were read,
which is where a resume's data continue from; the checkpoint records (S, μ), and a resume under another schedule
is refused in one line, since its data position would differ. A checkpoint written inside a generation holds
this process's kept micro-batches (`rollout_rank<r>.safetensors`, no pickle: checkpoint/state_files.py), so a
resume continues the generation bitwise instead of sampling it again from other weights; on another number of
processes or micro-batches per step, where the shares would not be this process's, it is refused in one line.

Such a resume runs the generation's remaining steps before the data path reads again, and the data path restores
the RNG states at its first read (data/loaders.py: creating its iterator draws from them). So the states are
restored at once, and at that first read the data path gets back the states of just before it (`rng_pending`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_trainer.checkpoint import state_files
from accel_trainer.data.rng import apply_rng_states, capture_rng_states
from accel_trainer.errors import ConfigError, RecipeError

Made = list[tuple[int, Any]]  # (epoch, micro-batch) pairs, as the loop reads them


def generation_file_name(process_index: int) -> str:
    return f"rollout_rank{process_index}.safetensors"


@dataclass
class Generations:
    """The current generation of a recipe whose rollout feeds `steps_per_generation` steps `num_iterations` times;
    registered with the checkpointer for its schedule (train_state.json's `rollout_schedule`)."""

    steps_per_generation: int
    num_iterations: int
    accumulation_steps: int
    made: Made | None = None  # the current generation's micro-batches, once rolled out or restored
    rng_pending: bool = False  # a resume inside a generation: the data path's first read gets the states before it
    _before_read: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if min(self.steps_per_generation, self.num_iterations) < 1:
            raise RecipeError(
                f"rollout_schedule() returned ({self.steps_per_generation}, {self.num_iterations}): give (steps,"
                " passes) of 1 or more"
            )

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
            if self.rng_pending:
                self._before_read = capture_rng_states()
            self.made = roll(fetch(self.steps_per_generation * self.accumulation_steps))
            if self.every > 1 and step == 1:
                _check_storable(self.made)
        assert self.made is not None, "a resume inside a generation restores it"  # restore's
        start = index % self.steps_per_generation * self.accumulation_steps
        return iter(self.made[start : start + self.accumulation_steps])

    def rng_before_read(self) -> None:
        """The data path's RNG restore after a resume inside a generation: the states of just before its read."""
        if self._before_read is not None:
            apply_rng_states(self._before_read)
        self._before_read, self.rng_pending = None, False

    def inside(self, step: int) -> bool:
        """Whether steps of the generation step `step` trained in are still to come."""
        return step % self.every != 0

    def state_dict(self) -> dict[str, Any]:
        return {"rollout_schedule": [self.steps_per_generation, self.num_iterations]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Refuse, in one line, a checkpoint of another schedule: its data were read at another pace.

        Raises:
            ConfigError: the checkpoint's (steps_per_generation, num_iterations) differ from this run's.
        """
        recorded = saved.get("rollout_schedule")
        if recorded is not None and list(recorded) != [self.steps_per_generation, self.num_iterations]:
            raise ConfigError(
                f"the checkpoint was trained with steps_per_generation={recorded[0]} num_iterations={recorded[1]},"
                f" this run has {self.steps_per_generation} and {self.num_iterations}: its data were read a"
                " generation at a time at that pace; resume with its values, or start a new run"
            )

    def save(self, folder: Path, process_index: int, step: int) -> None:
        """This process's micro-batches of the generation, where a checkpoint of `step` falls inside it."""
        if self.made is not None and self.inside(step):
            kept = {"made": self.made, "accumulation_steps": self.accumulation_steps}
            state_files.save(kept, folder / generation_file_name(process_index))

    def restore(self, folder: Path, process_index: int, step: int, world_size: tuple[int, int]) -> None:
        """The generation a checkpoint of `step` was written inside, `world_size` (saved, now) agreeing.

        Raises:
            ConfigError: the checkpoint was written inside a generation on another number of processes or of
                micro-batches per step.
        """
        if not self.inside(step):
            return
        saved, now = world_size
        path = folder / generation_file_name(process_index)
        kept = state_files.load(path) if saved == now and path.is_file() else {}
        if kept.get("accumulation_steps") != self.accumulation_steps:
            first = step - (step - 1) % self.every - 1
            raise ConfigError(
                f"checkpoint {folder.name} was written inside a rollout's generation (steps {first + 1}-"
                f"{first + self.every}) on {saved} process(es) of {kept.get('accumulation_steps', '?')} micro-"
                f"batch(es) a step: resume it on {saved} with its micro_batch_size, or from a checkpoint at a"
                f" multiple of steps_per_generation x num_iterations = {self.every} (save_every_steps)"
            )
        self.made = [(int(epoch), batch) for epoch, batch in kept["made"]]
        self.rng_pending = True


def _check_storable(made: Made) -> None:
    """Refuse, at the first rollout, what a checkpoint inside a generation could not hold (not at that save)."""
    try:
        state_files.split(made)
    except state_files.StateFileError as error:
        raise RecipeError(
            f"rollout returned micro-batches a checkpoint cannot hold ({error}): return dicts of tensors, numbers"
            " and strings"
        ) from None

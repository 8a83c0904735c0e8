"""A rollout feeding several optimizer steps (accel_trainer/checkpoint/generations.py): run at a generation's first
step on its steps' micro-batches, each step trained on its share pass after pass, the data read a generation at a
time, and a checkpoint inside a generation holding what its remaining steps train on."""

import pytest
import torch

from accel_trainer.checkpoint.generations import Generations
from accel_trainer.errors import ConfigError, RecipeError


def test_each_step_trains_on_its_share_pass_after_pass_and_the_data_are_read_a_generation_at_a_time():
    generations = Generations(steps_per_generation=2, num_iterations=2, accumulation_steps=3)
    data, reads, rolled = iter(range(100)), [], []

    def fetch(count):
        reads.append(count)
        return [(0, next(data)) for _ in range(count)]

    def roll(fetched):
        rolled.append(len(fetched))
        return [(epoch, f"made {batch}") for epoch, batch in fetched]

    shares = [[batch for _, batch in generations.micro_batches(step, fetch, roll)] for step in range(1, 7)]

    first, second, next_first = (
        ["made 0", "made 1", "made 2"],
        ["made 3", "made 4", "made 5"],
        ["made 6", "made 7", "made 8"],
    )
    assert shares == [first, second, first, second, next_first, ["made 9", "made 10", "made 11"]]
    assert reads == rolled == [6, 6]  # at steps 1 and 5: two steps' micro-batches each
    assert [generations.data_steps(step) for step in range(7)] == [0, 2, 2, 2, 2, 4, 4]


def test_a_checkpoint_inside_a_generation_holds_it_and_resumes_it_on_as_many_processes_only(tmp_path):
    saved = Generations(2, 2, 1, made=[(0, {"ids": torch.arange(3)}), (1, {"ids": None})])
    saved.save(tmp_path, process_index=0, step=2)
    saved.save(tmp_path / "missing", process_index=0, step=4)  # at a generation's end: nothing to keep

    restored = Generations(2, 2, 1)
    restored.restore(tmp_path, process_index=0, step=2, world_size=(1, 1))
    assert [epoch for epoch, _ in restored.made] == [0, 1] and restored.made[0][1]["ids"].tolist() == [0, 1, 2]
    Generations(2, 2, 1).restore(tmp_path / "missing", process_index=0, step=4, world_size=(2, 1))  # not inside
    with pytest.raises(ConfigError, match=r"steps 1-4\) on 2 process\(es\) .*: resume it on 2 .* = 4"):
        Generations(2, 2, 1).restore(tmp_path, process_index=0, step=3, world_size=(2, 1))
    with pytest.raises(ConfigError, match=r"of 1 micro-batch\(es\) a step: resume it on 1 with its micro_batch_size"):
        Generations(2, 2, accumulation_steps=2).restore(tmp_path, process_index=0, step=2, world_size=(1, 1))


def test_a_checkpoint_of_another_schedule_or_a_schedule_below_one_is_one_line():
    with pytest.raises(ConfigError, match="steps_per_generation=2 num_iterations=2, this run has 1 and 2"):
        Generations(1, 2, 1).load_state_dict(Generations(2, 2, 1).state_dict())
    Generations(1, 2, 1).load_state_dict({})  # a checkpoint of a run without a rollout schedule: nothing to check
    with pytest.raises(RecipeError, match=r"rollout_schedule\(\) returned \(0, 1\)"):
        Generations(0, 1, 1)


def test_a_rollout_whose_batches_a_checkpoint_cannot_hold_is_refused_at_the_first_rollout():
    generations = Generations(2, 1, 1)
    with pytest.raises(RecipeError, match="rollout returned micro-batches a checkpoint cannot hold"):
        generations.micro_batches(1, lambda count: [(0, {})] * count, lambda made: [(0, {"f": print})] * len(made))

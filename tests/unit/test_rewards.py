"""Reward functions named on the command line (`rewards=FILE.py:fn,module:fn`) are found, called with TRL's
signature, and a function that is missing or misbehaves is a one-line error naming it
(accel_trainer/contract/rewards.py)."""

import math
import textwrap
from pathlib import Path

import pytest
import torch

from accel_trainer.contract import rewards
from accel_trainer.errors import ConfigError, RecipeError

FUNCTIONS = """
def correct(prompts, completions, answer, **columns):
    return [1.0 if completion.strip() == str(wanted) else 0.0 for completion, wanted in zip(completions, answer)]

def short(prompts, completions, **columns):
    return [None if not completion else -len(completion) for completion in completions]

def raises(prompts, completions, **columns):
    raise ValueError("no answer column")

def too_few(prompts, completions, **columns):
    return [1.0]

def words(prompts, completions, **columns):
    return ["good" for _ in completions]
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return path


def test_functions_from_a_file_and_a_module_score_each_completion_with_the_datasets_columns(reward_file):
    functions = rewards.reward_functions(f"{reward_file}:correct, {reward_file}:short,math:fsum")
    assert [function.name for function in functions] == ["correct", "short", "fsum"]

    table = rewards.scores(functions[:2], ["2+2=", "2+2=", "1+5="], ["4", "", "7"], answer=[4, 4, 6])

    assert table.shape == (3, 2)
    assert table[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert table[0, 1] == -1 and math.isnan(table[1, 1])  # None: not scored by that function


def test_weights_are_one_each_unless_given_one_per_function():
    assert rewards.reward_weights("", 2).tolist() == [1.0, 1.0]
    assert rewards.reward_weights("1,0.5", 2).tolist() == [1.0, 0.5]
    with pytest.raises(ConfigError, match="reward_weights=1: 1 weights for 2 reward functions; give one each"):
        rewards.reward_weights("1", 2)
    with pytest.raises(ConfigError, match="reward_weights=a,b: give numbers"):
        rewards.reward_weights("a,b", 2)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("raises", "reward function raises raised ValueError at my_rewards.py:9: no answer column"),
        ("too_few", "reward function too_few returned 1 values for 2 completions: return one number each"),
        ("words", "reward function words returned a str: return numbers"),
    ],
)
def test_a_function_that_misbehaves_is_a_one_line_error_naming_it(reward_file, name, message):
    (function,) = rewards.reward_functions(f"{reward_file}:{name}")
    with pytest.raises(RecipeError, match=message):
        rewards.scores([function], ["p", "p"], ["a", "b"])


def test_a_function_asking_for_a_column_the_data_lacks_is_told_the_columns_it_is_given(reward_file):
    (function,) = rewards.reward_functions(f"{reward_file}:correct")  # correct(prompts, completions, answer)
    message = r"correct raised TypeError: .*'answer' \(it is given prompts, completions and the data's columns: colour"
    with pytest.raises(RecipeError, match=message):
        rewards.scores([function], ["p", "p"], ["a", "b"], colour=["red", "blue"])


def test_a_function_that_cannot_be_found_is_a_one_line_error(reward_file, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases = [
        ("", "rewards= names no reward function"),
        (f"{reward_file}", "names no function; write FILE.py:function or module:function"),
        (f"{tmp_path}/missing.py:fn", "missing.py is not a file"),
        (f"{reward_file}:absent", "my_rewards.py has no function absent"),
        ("no_such_package.rewards:fn", "no module no_such_package"),
        (f"{broken}:fn", "broken.py failed to import: ModuleNotFoundError"),
        (f"{reward_file}:short,{reward_file}:short", "two reward functions have the same name"),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message):
            rewards.reward_functions(spec)


def test_tensors_of_one_value_count_as_numbers(reward_file):
    function = rewards.RewardFunction(
        "tensor", lambda prompts, completions, **_: [torch.tensor(0.5)] * len(completions)
    )
    assert rewards.scores([function], ["p"], ["a"]).tolist() == [[0.5]]


def test_logged_figures_are_trls_means_and_a_group_with_one_scored_completion_has_no_zero_spread():
    nan = math.nan
    table = torch.tensor([[1.0], [1.0], [0.0], [1.0], [nan], [0.0]])  # three groups of two, one function
    batch = {
        "rewards": rewards.weighted(table, torch.ones(1)),
        "per_function": table,
        "reward_std": torch.tensor(0.5),
        "completion_lengths": torch.tensor([3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
    }
    figures = {name: (float(value), float(count)) for name, (value, count) in
               rewards.logged_figures(batch, ["f"], num_generations=2).items()}  # fmt: skip
    assert figures["reward"] == (3.0, 5.0)  # the unscored completion is not counted
    assert figures["rewards/f"] == (3.0, 5.0)
    assert figures["completion_length"] == (33.0, 6.0)
    assert figures["reward_std"] == (3.0, 6.0)
    assert figures["frac_reward_zero_std"] == (1.0, 3.0)  # TRL's nanstd: (NaN, 0) is not "all equal"


def test_reward_files_are_named_by_absolute_paths_modules_as_given(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    spec = rewards.absolute_files("my_rewards.py:correct, accel_trainer.data.arithmetic:short,~/r.py:f")
    home = str(Path("~").expanduser())
    assert spec == f"{reward_file}:correct,accel_trainer.data.arithmetic:short,{home}/r.py:f"

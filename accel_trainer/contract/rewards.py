"""The user's reward functions of online RL, named on the command line and called as TRL calls them.

    accel-trainer train grpo ... rewards=rewards.py:correct,rewards.py:formatted reward_weights=1,0.5
    accel-trainer train grpo ... rewards=my_package.rewards:correct

A reward function has TRL's signature, `fn(prompts, completions, **columns) -> list[float | None]`: one prompt
and one completion per completion sampled (a prompt repeated for each of its group's completions; text, or a
conversation's messages with the completion as `[{"role": "assistant", "content": ...}]`), the dataset's other
columns as keyword lists of the same length, and `completion_ids` (token ids). It returns one number per
completion, or None where it does not apply (TRL's convention: such a completion counts in no mean, and where no
function scores it, its advantage is 0). A function that is not found, raises, or returns another count or
something that is not a number is a one-line error naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract import policy_gradient
from accel_trainer.errors import ConfigError, RecipeError


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and the name its mean is logged under (`rewards/<name>`)."""

    name: str
    function: Callable[..., Any]


def reward_functions(spec: str) -> list[RewardFunction]:
    """The functions `spec` names, comma-separated: `path/to/file.py:function` or `module.path:function`.

    Raises:
        ConfigError: an empty spec, a name without `:function`, a file or module not found, no such function.
    """
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise ConfigError(
            "rewards= names no reward function: give FILE.py:function or module:function, comma-separated"
        )
    functions = [_one(name) for name in names]
    seen = [function.name for function in functions]
    if len(set(seen)) < len(seen):
        raise ConfigError(f"rewards={spec}: two reward functions have the same name; give each its own")
    return functions


def absolute_files(spec: str) -> str:
    """`spec` with each FILE.py made an absolute path, as data= paths are: the run's config.yaml names the same
    files from any folder (a resume, `--config`)."""
    parts = []
    for part in (part.strip() for part in spec.split(",") if part.strip()):
        where, colon, attribute = part.rpartition(":")
        absolute = str(Path(where).expanduser().resolve()) if where.endswith(".py") else where
        parts.append(f"{absolute}{colon}{attribute}" if colon else part)
    return ",".join(parts)


def reward_weights(spec: str, count: int) -> torch.Tensor:
    """The weight of each of `count` reward functions: `spec` comma-separated numbers, or empty for 1 each."""
    if not spec.strip():
        return torch.ones(count)
    try:
        weights = [float(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"reward_weights={spec}: give numbers, comma-separated, one per reward function") from None
    if len(weights) != count:
        raise ConfigError(f"reward_weights={spec}: {len(weights)} weights for {count} reward functions; give one each")
    return torch.tensor(weights)


def scores(
    functions: Sequence[RewardFunction], prompts: list[Any], completions: list[Any], **columns: list[Any]
) -> torch.Tensor:
    """Each function's reward of each completion, shape (completions, functions), NaN where it returned None.

    Raises:
        RecipeError: a function that raised, or returned another count or something not a number.
    """
    columns_of = {name: list(values) for name, values in columns.items()}
    table = torch.empty(len(completions), len(functions), dtype=torch.float64)
    for index, reward in enumerate(functions):
        try:
            values = reward.function(prompts=prompts, completions=completions, **columns_of)
        except Exception as error:  # the user's code: named in one line, its own message kept, where it raised
            raise RecipeError(_raised(reward, error, sorted(columns_of))) from error
        table[:, index] = torch.tensor(_numbers(reward.name, values, len(completions)), dtype=torch.float64)
    return table


def weighted(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: its functions' rewards weighted and summed, NaN where none scored it (TRL's)."""
    total = (table * weights.to(table.dtype)).nansum(dim=1)
    return total.masked_fill(table.isnan().all(dim=1), math.nan)


def logged_figures(
    batch: dict[str, torch.Tensor], names: list[str], num_generations: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What TRL's GRPO logs of a micro-batch's completions, as loss terms with their own counts (exact means over
    a log window's completions and processes): `reward` (weighted, the scored ones), `reward_std` (the step's),
    `completion_length`, `frac_reward_zero_std` (groups of equal rewards), `rewards/<name>` for each function.
    From the batch's `rewards`, `per_function` (completions x functions), `reward_std` and `completion_lengths`."""
    total, table = batch["rewards"], batch["per_function"]
    completions = torch.tensor(float(len(total)))
    groups = total.view(-1, num_generations)
    spread = policy_gradient.nan_std(groups, dim=1)  # TRL's nanstd: a group with under 2 scored has no zero spread
    figures = {
        "reward": (total.nansum(), (~total.isnan()).sum()),
        "reward_std": (batch["reward_std"] * completions, completions),
        "completion_length": (batch["completion_lengths"].sum(), completions),
        "frac_reward_zero_std": ((spread < 1e-8).sum(), torch.tensor(float(len(groups)))),
    }
    for index, name in enumerate(names):
        column = table[:, index]
        figures[f"rewards/{name}"] = (column.nansum(), (~column.isnan()).sum())
    return {name: (value.float(), count.float()) for name, (value, count) in figures.items()}


def _raised(reward: RewardFunction, error: Exception, columns: list[str]) -> str:
    """One line for a reward function that raised: its name, the error, and where in the function's file it was
    raised; raised by the call itself (a parameter the data has no column for), the columns it is given."""
    home = getattr(getattr(reward.function, "__code__", None), "co_filename", None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == home]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    given = "" if frames else f" (it is given prompts, completions and the data's columns: {', '.join(columns)})"
    return f"reward function {reward.name} raised {type(error).__name__}{where}: {error}{given}"


def _numbers(name: str, values: Any, expected: int) -> list[float]:
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != expected:
        got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
        raise RecipeError(f"reward function {name} returned {got} for {expected} completions: return one number each")
    numbers = []
    for value in values:
        if value is None:
            numbers.append(math.nan)
        elif isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            numbers.append(float(value))
        else:
            raise RecipeError(f"reward function {name} returned a {type(value).__name__}: return numbers (or None)")
    return numbers


def _one(name: str) -> RewardFunction:
    where, _, attribute = name.rpartition(":")
    if not where or not attribute:
        raise ConfigError(f"rewards: {name!r} names no function; write FILE.py:function or module:function")
    module = _file_module(Path(where)) if where.endswith(".py") else _module(where)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"rewards: {where} has no function {attribute}")
    return RewardFunction(attribute, function)


def _file_module(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"rewards: {path} is not a file; give the path of your reward functions' .py file")
    module_name = f"accel_trainer_rewards_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None  # a .py file
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: named in one line
        del sys.modules[module_name]
        raise ConfigError(f"rewards: {path} failed to import: {type(error).__name__}: {error}") from error
    return module


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ConfigError(
            f"rewards: no module {error.name} ({name}); give FILE.py:function or an importable module"
        ) from None

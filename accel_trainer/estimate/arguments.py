"""The words of `accel-trainer estimate`, read before torch is imported, so that a mistake in them is said at once.

`estimate.command` imports torch, accelerate and datasets (about 5 s); a missing recipe or layout, a bad
`--device_memory_gb` or a mistyped option needs none of them.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from accel_trainer.config.command_line import CommandLine, parse_command_line
from accel_trainer.errors import ConfigError

OWN_OPTIONS = ("--json", "--device_memory_gb")


@dataclass(frozen=True)
class EstimateArguments:
    """What the command was asked: the recipe's name or file, its command line (layout= among it), and its own
    options."""

    recipe: str
    line: CommandLine
    as_json: bool
    device_gb: float | None


def parse_estimate_arguments(words: list[str]) -> EstimateArguments:
    """The words after `estimate`.

    Raises:
        ConfigError: no recipe or layout, a bad `--device_memory_gb`, an option that is nearly one of its own.
    """
    as_json, device_gb, words = _own_options(words)
    if not words or words[0].startswith(("-", "layout=")) or "=" in words[0]:
        raise ConfigError("estimate needs a recipe: accel-trainer estimate NAME layout=LAYOUT [key=value ...]")
    line = parse_command_line(words[1:])
    if line.layout is None:
        raise ConfigError(f"estimate needs a layout: accel-trainer estimate {words[0]} layout=8gpu_fsdp ...")
    return EstimateArguments(words[0], line, as_json, device_gb)


def _own_options(words: list[str]) -> tuple[bool, float | None, list[str]]:
    """`--json` and `--device_memory_gb G` (or `=G`), taken out of the words; the rest are the recipe's."""
    own_end = words.index("--") if "--" in words else len(words)
    as_json, device_gb, rest, index = False, None, [], 0
    while index < own_end:
        word = words[index]
        if word == "--json":
            as_json = True
        elif word.startswith("--device_memory_gb"):
            value = word.partition("=")[2] or (words[index + 1] if index + 1 < own_end else "")
            index += 0 if "=" in word else 1
            device_gb = _gigabytes(value)
        else:
            _refuse_a_near_miss(word)
            rest.append(word)
        index += 1
    return as_json, device_gb, rest + words[own_end:]


def _gigabytes(value: str) -> float:
    try:
        device_gb = float(value)
    except ValueError:
        device_gb = math.nan
    if not math.isfinite(device_gb) or device_gb <= 0:
        raise ConfigError(f"--device_memory_gb needs a number of GB above 0 (80 for an H100), not {value!r}")
    return device_gb


def _refuse_a_near_miss(word: str) -> None:
    """`--jsn` is `--json` mistyped, not a config key `jsn` (which would be said as needing a value)."""
    name = word.partition("=")[0]
    if name.startswith("--") and (near := difflib.get_close_matches(name, OWN_OPTIONS, n=1, cutoff=0.7)):
        raise ConfigError(f"estimate has no option {name}; did you mean {near[0]}?")

"""The words of a recipe command: options, then overrides written the way users already write them.

    python recipes/vae.py max_steps=100 lr=0.01            # key=value, the framework's own form
    python recipes/vae.py --max_steps 100 --lr=0.01        # argparse's habits: the same two overrides
    python recipes/vae.py --config base.yaml --max-steps 100 --print-config

`--key value` and `--key=value` are `key=value` (a dash in the key reads as an underscore, so `--max-steps` is
`max_steps`); `lr=0.1 --lr 0.2` is the last one written, as with key=value twice. `--lr output_dir=x` is a
`--lr` without its value, not `lr='output_dir=x'` (a value of that shape is written `--key=value`). The options
are `--config FILE` (values applied before the overrides), `--print-config` (print the resolved config and layout
settings, train nothing) and `--help`; `layout=NAME|FILE` names the layout, and the words after `--` are options
for the launcher that `layout=` starts. A word that is none of these is a one-line error naming the forms that work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from accel_trainer.config.fields import parse_overrides
from accel_trainer.errors import ConfigError

FORMS = "write key=value, --key value or --key=value"
_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # `--lr output_dir=x` forgot lr's value; x is not it


@dataclass
class CommandLine:
    """What a recipe command asked for."""

    overrides: dict[str, str] = field(default_factory=dict)
    config_file: str | None = None
    print_config: bool = False
    layout: str | None = None  # layout=NAME|FILE (parallel/layout_file.py): not a config value
    launcher_options: list[str] = field(default_factory=list)  # the words after `--`, for the layout's launcher
    own_words: list[str] = field(default_factory=list)  # the words before `--`: what the layout's workers are given


def parse_command_line(words: list[str]) -> CommandLine:
    """Read a recipe command's words (after the recipe) into its options and `key=value` overrides.

    Raises:
        ConfigError: an option without its value, a single-dash word, or a word that is not an override.
    """
    line = CommandLine(own_words=words[: words.index("--")] if "--" in words else list(words))
    pairs: list[str] = []
    remaining = iter(words)
    for word in remaining:
        if word == "--":
            line.launcher_options = list(remaining)
            break
        if word in ("--help", "-h"):
            continue  # answered before the words are read (training.py), so that a command gone wrong still gets help
        if word == "--print-config":
            line.print_config = True
        elif word.startswith("--"):
            key, sep, value = word[2:].partition("=")
            if not key:
                raise ConfigError(f"{word!r} names no key: {FORMS}")
            if key in ("print-config", "help"):
                raise ConfigError(f"--{key} takes no value: write --{key} alone")
            if not sep:
                value = next(remaining, None)  # type: ignore[assignment]
                if value is None or value.startswith("--") or _OVERRIDE.match(value):  # the next word is its own
                    if key == "config":
                        raise ConfigError("--config needs a file: --config path/to/config.yaml")
                    raise ConfigError(f"{word} needs a value: {word} VALUE, {word}=VALUE or {key}=VALUE")
            if key == "config":
                line.config_file = value
            else:
                pairs.append(f"{key.replace('-', '_')}={value}")
        elif word.startswith("-"):
            raise ConfigError(f"unknown option {word!r}: {FORMS} (options: --config FILE, --print-config, --help)")
        else:
            pairs.append(word)
    line.overrides = parse_overrides(pairs)
    line.layout = line.overrides.pop("layout", None)
    if line.launcher_options and line.layout is None:
        raise ConfigError(f"launcher options after -- ({' '.join(line.launcher_options)}) need a layout=NAME|FILE")
    return line

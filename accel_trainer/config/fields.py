"""Typed dataclass fields read from text: values from the command line and YAML, docs from the source.

Shared by the recipe config (config/train_config.py) and the layout settings (config/layout.py). Unknown keys
are errors with a close-match hint and values are checked against the field's type, so a typo never passes silently (the
nanoGPT lesson). Each field carries a one-line docstring written under it; those docstrings are read from
the source and become `--help`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from accel_trainer.errors import ConfigError


def config_fields(config_cls: type) -> dict[str, Any]:
    """Map each field name of a config dataclass to its resolved type: the type of its first declaration, so a
    recipe's `micro_batch_size: int = 16` changes the framework field's default, not its type (auto stays)."""
    types_found: dict[str, Any] = {}
    for klass in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(klass):
            hints = typing.get_type_hints(klass)
            for name in inspect.get_annotations(klass):  # declared by this class itself
                types_found.setdefault(name, hints[name])
    return {
        f.name: types_found.get(f.name, typing.get_type_hints(config_cls)[f.name])
        for f in dataclasses.fields(config_cls)
    }


def field_docs(config_cls: type) -> dict[str, str]:
    """Read the docstring written under each field, walking the class and its bases.

    Attribute docstrings are not kept by Python at run time, so they are read from the source. Where there is
    none (a class defined in a notebook cell may have none), `field(..., metadata={"doc": "..."})` documents a
    field; it also wins over a docstring.
    """
    docs: dict[str, str] = {}
    for klass in reversed(config_cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        statements = body.body
        for stmt, nxt in zip(statements, statements[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    if dataclasses.is_dataclass(config_cls):
        for f in dataclasses.fields(config_cls):
            if "doc" in f.metadata:
                docs[f.name] = str(f.metadata["doc"])
    return docs


def describe_fields(config_cls: type) -> str:
    """The `--help` text: one line per field with its type, default and docstring."""
    docs = field_docs(config_cls)
    lines = []
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        shown_type = type_name(config_fields(config_cls)[f.name])
        lines.append(f"  {f.name}={default!r}  ({shown_type})  {docs.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def coerce_value(name: str, value: Any, expected: Any) -> Any:
    """Return `value` converted to the field's type, or raise ConfigError naming the field and the type.

    Strings (from the command line) are parsed; typed values (from YAML or Python) are checked. An int is
    accepted for a float field, a bool never for a number.
    """
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce_value(name, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={value!r}: expected {type_name(expected)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, args))}")
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise ConfigError(f"{name}={value!r}: expected a boolean (true or false)")
    if expected in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: expected {expected.__name__}, got a boolean")
        if isinstance(value, expected) or (expected is float and isinstance(value, int)):
            return expected(value)
        if isinstance(value, str):
            try:
                return expected(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r}: expected {expected.__name__}")
    if expected is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r}: expected a string")
    if origin in (tuple, list):
        items = [s for s in value.split(",") if s] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}={value!r}: expected a comma-separated list")
        item_type = args[0] if args else str
        return origin(coerce_value(name, item, item_type) for item in items)
    raise ConfigError(f"{name}: fields of type {type_name(expected)} are not supported in configs")


def parse_overrides(arguments: list[str]) -> dict[str, str]:
    """Turn `key=value` command-line words into a dict, rejecting anything else with a usage hint."""
    overrides: dict[str, str] = {}
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep or not key:
            raise ConfigError(f"{argument!r} is not an override: write key=value, for example max_steps=100")
        overrides[key.strip()] = value
    return overrides


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of config values; a missing or malformed file is a one-line ConfigError."""
    path = Path(path)
    try:
        loaded = yaml.load(path.read_text(), Loader=_ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as error:
        # An unclosed `[3` is found at the end of the file: the line where its construct began is the one to fix.
        mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        parts = (getattr(error, "context", None), getattr(error, "problem", None))
        what = ", ".join(str(part) for part in parts if part)
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}{': ' + what if what else ''}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value lines")
    return loaded


LAUNCHER_KEYS = dict.fromkeys(
    ("num_processes", "nproc_per_node", "world_size", "devices"),
    ": processes are the launcher's, not a config key: accelerate launch --config_file"
    " accelerate_configs/cpu_ddp.yaml recipes/NAME.py ..., torchrun --nproc_per_node N recipes/NAME.py ..., or"
    " at.train(NAME, num_processes=N)",
)
"""Keys users bring from other tools' command lines, answered with the way to start processes here."""


def _nearest_keys(key: str, known: list[str]) -> str:
    """The hint after an unknown key: the closest known one, or up to three near ones, never the whole list (a
    recipe has sixty keys); `--help` lists them all."""
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.4) or [k for k in known if key in k or k in key][:3]
    listed = " or ".join(map(repr, near))
    return f"; the nearest known keys are {listed} (--help lists them all)" if near else "; --help lists the keys"


def check_values(classes: tuple[type, ...], values: Mapping[Any, Any], where: str) -> tuple[dict[str, Any], ...]:
    """Type each value by the field of that name in one of `classes`; one dict of typed values per class.

    Raises:
        ConfigError: for a key no class has (with a close-match hint) or a value of the wrong type.
    """
    fields = [config_fields(cls) for cls in classes]
    known = [name for class_fields in fields for name in class_fields]
    checked: tuple[dict[str, Any], ...] = tuple({} for _ in classes)
    for key, value in values.items():
        owner = next((i for i, class_fields in enumerate(fields) if key in class_fields), None)
        if not isinstance(key, str) or owner is None:
            suggestion = _nearest_keys(str(key), known)
            suggestion = LAUNCHER_KEYS.get(str(key), suggestion)
            raise ConfigError(f"unknown config key {key!r} {where}{suggestion}")
        checked[owner][key] = coerce_value(key, value, fields[owner][key])
    return checked


def type_name(expected: Any) -> str:
    if typing.get_origin(expected) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(expected))
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(expected))
    if expected is type(None):
        return "None"
    return getattr(expected, "__name__", str(expected))


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads only true/false as booleans (as YAML 1.2 does).

    YAML 1.1 also reads yes/no/on/off as booleans, so `mixed_precision: no` would arrive as False and be
    rejected; left as strings, bool fields still accept those words through `_BOOL_WORDS`.
    """


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds of a duration like 2h30m, 90m, 45s or 1d (units d, h, m, s, in any combination).

    Raises:
        ConfigError: any other text.
    """
    parts = _DURATION.findall(text)
    if not text or "".join(number + unit for number, unit in parts) != text.replace(" ", ""):
        raise ConfigError(f"max_time={text!r}: write a duration such as 2h30m, 90m or 45s (units d, h, m, s)")
    return sum(float(number) * _SECONDS[unit] for number, unit in parts)


def parse_steps(text: str) -> tuple[int, int] | None:
    """`a-b` (or `a`) as the first and last optimizer step to profile; None for an empty text.

    Raises:
        ConfigError: anything else, or a range that is empty or starts before step 1.
    """
    if not text:
        return None
    first, _, last = text.partition("-")
    try:
        steps = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"profile_steps={text!r}: write first-last optimizer steps, for example 5-8") from None
    if steps[0] < 1 or steps[1] < steps[0]:
        raise ConfigError(f"profile_steps={text!r}: the steps must be 1 or more, first <= last")
    return steps


def declared_defaults(config_cls: type) -> dict[str, Any]:
    """Each field's declared default, as `config_to_dict` writes values (a field without one is left out): what
    a setting a later version adds is taken to be in a checkpoint or a run's identity that predates it."""
    defaults = {}
    for field in dataclasses.fields(config_cls):
        if field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        elif field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
    return {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}


def micro_batch_size_given(config_file: str | Path | None, overrides: Mapping[str, Any] | None) -> bool:
    """Whether the user set micro_batch_size (in the config file or an override), rather than leaving the recipe's
    default, which follows the layout (data/batching.py)."""
    return "micro_batch_size" in (overrides or {}) or (
        config_file is not None and "micro_batch_size" in load_config_file(config_file)
    )

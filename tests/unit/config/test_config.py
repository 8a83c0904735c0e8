"""Specification of the typed config: precedence, override parsing, errors, field docs and the YAML round trip."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from accel_trainer.config.fields import (
    coerce_value,
    config_fields,
    describe_fields,
    field_docs,
    load_config_file,
    parse_overrides,
    type_name,
)
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig, config_to_yaml, resolve_config, resolve_settings
from accel_trainer.errors import ConfigError
from conftest import REPO

SNAPSHOTS = REPO / "tests" / "snapshots"


@dataclass
class DemoConfig(TrainConfig):
    """A recipe's config: it changes framework defaults and adds its own fields."""

    max_steps: int = 7
    warmup_steps: int = 5
    lr: float = 2e-3
    width: int = 16
    """Width of the demo model."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Sizes of the hidden layers, comma-separated on the command line."""


def write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(callable_, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        callable_(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, "user errors are one line"
    return message


# --- precedence ------------------------------------------------------------------------------------------------


def test_precedence_is_field_defaults_then_recipe_config_then_file_then_overrides(tmp_path):
    config_file = write(tmp_path, "warmup_steps: 6\nlr: 3.0e-3\nwidth: 32\n")

    cfg = resolve_config(DemoConfig, config_file, {"lr": "4e-3"})

    assert cfg.seed == 0  # field default of TrainConfig
    assert cfg.max_steps == 7  # the recipe's Config default beats the field default
    assert cfg.warmup_steps == 6  # the file beats the recipe's Config
    assert cfg.width == 32  # the file also sets recipe fields
    assert cfg.lr == 4e-3  # the override beats the file


def test_without_file_or_overrides_the_recipe_config_defaults_are_used():
    assert resolve_config(DemoConfig) == DemoConfig()
    assert resolve_config(DemoConfig).max_steps == 7
    assert resolve_config(TrainConfig).max_steps == TrainConfig().max_steps


def test_an_empty_config_file_changes_nothing(tmp_path):
    assert resolve_config(DemoConfig, write(tmp_path, "")) == DemoConfig()


# --- override parsing ------------------------------------------------------------------------------------------


def test_overrides_are_key_value_words():
    assert parse_overrides(["max_steps=3", "output_dir=runs/a=b", "output_dir2="]) == {
        "max_steps": "3",
        "output_dir": "runs/a=b",
        "output_dir2": "",
    }


@pytest.mark.parametrize("word", ["max_steps", "=3", "--max_steps"])
def test_a_word_that_is_not_key_value_is_a_config_error_showing_the_form(word):
    message = error_of(parse_overrides, [word])
    assert repr(word) in message
    assert "key=value" in message


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("max_steps", "100", 100),
        ("max_steps", "1_000", 1000),
        ("lr", "1e-3", 1e-3),
        ("lr", "0.5", 0.5),
        ("lr", "2", 2.0),
        ("output_dir", "runs/demo", "runs/demo"),
        ("output_dir", "", ""),
        ("lr_schedule", "linear", "linear"),
        ("mixed_precision", "bf16", "bf16"),
        ("mixed_precision", "no", "no"),
        ("mixed_precision", "None", None),
        ("mixed_precision", "null", None),
        ("hidden_sizes", "32,16", (32, 16)),
    ],
)
def test_an_override_string_is_parsed_to_the_field_type(key, text, expected):
    cfg, layout = resolve_settings(DemoConfig, overrides={key: text})
    value = getattr(cfg if hasattr(cfg, key) else layout, key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("word", "expected"),
    [("true", True), ("True", True), ("yes", True), ("on", True), ("1", True)]
    + [("false", False), ("FALSE", False), ("no", False), ("off", False), ("0", False)],
)
def test_a_boolean_override_accepts_the_usual_words(word, expected):
    assert resolve_config(TrainConfig, overrides={"show_progress_bar": word}).show_progress_bar is expected


def test_typed_values_from_python_are_checked_and_an_int_is_accepted_for_a_float():
    cfg = resolve_config(TrainConfig, overrides={"max_steps": 5, "lr": 1, "show_progress_bar": False})
    assert (cfg.max_steps, cfg.lr, cfg.show_progress_bar) == (5, 1.0, False)
    assert type(cfg.lr) is float


def test_mixed_precision_is_optional_and_defaults_to_the_launchers_setting():
    assert LayoutSettings().mixed_precision is None
    assert coerce_value("mixed_precision", None, config_fields(LayoutSettings)["mixed_precision"]) is None


@pytest.mark.parametrize(
    ("key", "value", "expected_type"),
    [
        ("max_steps", "ten", "int"),
        ("max_steps", "1.5", "int"),
        ("max_steps", True, "int"),
        ("lr", "fast", "float"),
        ("lr", False, "float"),
        ("show_progress_bar", "maybe", "boolean"),
        ("output_dir", 3, "string"),
        ("lr_schedule", "step", "'cosine', 'linear', 'constant'"),
        ("mixed_precision", "fp32", "'no' | 'bf16' | 'fp16' | 'fp8' | None"),
        ("hidden_sizes", "32,wide", "int"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_config_error_naming_the_field_and_the_type(key, value, expected_type):
    message = error_of(resolve_config, DemoConfig, overrides={key: value})
    assert message.startswith(f"{key}=")
    assert expected_type in message


def test_an_unsupported_field_type_is_reported_rather_than_passed_through():
    message = error_of(coerce_value, "table", "x", dict)
    assert "table" in message and "not supported" in message


# --- unknown keys ----------------------------------------------------------------------------------------------


def test_an_unknown_override_key_is_a_config_error_with_a_did_you_mean_hint():
    message = error_of(resolve_config, TrainConfig, overrides={"max_stepz": "3"})
    assert "unknown config key 'max_stepz'" in message
    assert "did you mean 'max_steps'?" in message


def test_an_unknown_key_with_no_close_match_names_the_nearest_keys_not_all_sixty():
    message = error_of(resolve_config, TrainConfig, overrides={"steps_max": "3"})
    assert "the nearest known keys are 'max_steps' or" in message
    assert "--help lists them all" in message and "micro_batch_size" not in message
    assert error_of(resolve_config, TrainConfig, overrides={"qqqqqq": "3"}).endswith("; --help lists the keys")


def test_a_recipe_field_is_unknown_to_the_base_config():
    assert "width" in error_of(resolve_config, TrainConfig, overrides={"width": "3"})


def test_an_unknown_key_in_the_config_file_names_the_file_and_hints(tmp_path):
    config_file = write(tmp_path, "widht: 3\n")
    message = error_of(resolve_config, DemoConfig, config_file)
    assert str(config_file) in message
    assert "did you mean 'width'?" in message


def test_a_non_string_key_in_the_config_file_is_a_config_error(tmp_path):
    assert "unknown config key 1" in error_of(resolve_config, TrainConfig, write(tmp_path, "1: 2\n"))


# --- config files ----------------------------------------------------------------------------------------------


def test_a_config_file_is_typed_like_overrides(tmp_path):
    config_file = write(tmp_path, "lr: 1e-3\nmax_steps: 20\nhidden_sizes: [8, 4]\nmixed_precision: null\n")
    cfg, layout = resolve_settings(DemoConfig, config_file)
    assert (cfg.lr, cfg.max_steps, cfg.hidden_sizes, layout.mixed_precision) == (1e-3, 20, (8, 4), None)


def test_yaml_yes_no_on_off_are_words_so_mixed_precision_no_is_the_string_no(tmp_path):
    # YAML 1.1 would read `no` as False, which is not one of mixed_precision's choices.
    cfg, layout = resolve_settings(TrainConfig, write(tmp_path, "mixed_precision: no\nshow_progress_bar: off\n"))
    assert layout.mixed_precision == "no"
    assert cfg.show_progress_bar is False


def test_malformed_yaml_is_a_one_line_config_error_with_the_line(tmp_path):
    config_file = write(tmp_path, "lr: 1.0\nmax_steps: [1, 2\n")
    message = error_of(load_config_file, config_file)
    assert str(config_file) in message
    assert "not valid YAML at line 2: while parsing a flow sequence, expected ',' or ']'" in message  # where [ opened


def test_a_missing_config_file_is_a_one_line_config_error(tmp_path):
    missing = tmp_path / "missing.yaml"
    message = error_of(resolve_config, TrainConfig, missing)
    assert str(missing) in message and "does not exist" in message


@pytest.mark.parametrize("text", ["- lr\n- max_steps\n", "just a string\n", "3\n"])
def test_a_config_file_that_is_not_a_mapping_is_a_one_line_config_error(tmp_path, text):
    assert "must hold a mapping" in error_of(load_config_file, write(tmp_path, text))


# --- field docs and --help -------------------------------------------------------------------------------------


def test_field_docs_reads_the_docstring_written_under_each_field():
    docs = field_docs(TrainConfig)
    assert docs["max_steps"] == "Number of optimizer steps to train for."
    assert docs["seed"].startswith("Seed of model initialisation")


def test_field_docs_of_a_subclass_adds_its_fields_and_keeps_the_base_docs_of_redefined_fields():
    docs = field_docs(DemoConfig)
    assert docs["width"] == "Width of the demo model."
    assert docs["hidden_sizes"] == "Sizes of the hidden layers, comma-separated on the command line."
    assert docs["max_steps"] == field_docs(TrainConfig)["max_steps"]  # redefined without a docstring


@pytest.mark.parametrize("group", [TrainConfig, LayoutSettings])
def test_every_config_field_and_layout_setting_has_a_docstring(group):
    docs = field_docs(group)
    undocumented = [f.name for f in dataclasses.fields(group) if not docs.get(f.name)]
    assert undocumented == []


@pytest.mark.parametrize("config_cls", [TrainConfig, DemoConfig, LayoutSettings])
def test_describe_fields_has_a_line_per_field_with_default_type_and_doc(config_cls):
    text = describe_fields(config_cls)
    docs = field_docs(config_cls)
    lines = text.splitlines()
    assert len(lines) == len(dataclasses.fields(config_cls))
    for line, field in zip(lines, dataclasses.fields(config_cls), strict=True):
        assert line.strip().startswith(f"{field.name}={getattr(config_cls(), field.name)!r}")
        assert line.endswith(docs[field.name])


def override_surface() -> str:
    """Every key a user can type, in both groups, with its type and default: one line each."""
    lines = []
    for group in (TrainConfig, LayoutSettings):
        for name, expected in config_fields(group).items():
            lines.append(f"{group.__name__}.{name}: {type_name(expected)} = {getattr(group(), name)!r}")
    return "\n".join(lines) + "\n"


def test_the_whole_override_surface_is_frozen():
    """Keys are typed on command lines, in config files and in docs: a change to any must be deliberate.

    After a deliberate change, from tests/: python -c "import test_config as t; print(t.override_surface(), end='')" \
        > snapshots/override_surface.txt
    """
    assert override_surface() == (SNAPSHOTS / "override_surface.txt").read_text()


# --- the resolved config as YAML ---------------------------------------------------------------------------------


def test_config_to_yaml_round_trips_through_resolve_config(tmp_path):
    cfg = resolve_config(
        DemoConfig,
        overrides={
            "seed": "3",
            "lr": "1e-4",
            "lr_schedule": "linear",
            "show_progress_bar": "false",
            "output_dir": "runs/demo",
            "hidden_sizes": "8,4",
        },
    )
    config_file = write(tmp_path, config_to_yaml(cfg), "resolved.yaml")
    assert resolve_config(DemoConfig, config_file) == cfg


def test_config_to_yaml_of_the_defaults_round_trips_too(tmp_path):
    config_file = write(tmp_path, config_to_yaml(TrainConfig()), "resolved.yaml")
    assert resolve_config(TrainConfig, config_file) == TrainConfig()

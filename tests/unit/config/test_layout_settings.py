"""Layout settings: the hardware axis, apart from the recipe's config, set per layout or per run.

A recipe cannot default them; a settings file beside the accelerate config applies to a plain
`accelerate launch --config_file` of that layout; `--config` files and key=value overrides still win.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import yaml

import accel_trainer as at
from accel_trainer.config.layout import LayoutSettings, settings_file_of
from accel_trainer.config.train_config import resolve_settings
from accel_trainer.parallel.accelerator import check_fsdp_options
from accel_trainer.recipe import Recipe
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    REPO,
    TEST_OVERRIDES,
    WORKERS,
    clean_env,
    dump_env,
    free_port,
    rank_summary,
    run_command,
)

QUICK_VAE = ["sample_latent=false", "max_steps=4", "log_every_steps=2", "eval_every_steps=0"]


def write_yaml(path, values: dict):
    path.write_text(yaml.safe_dump(values))
    return path


def test_no_layout_setting_is_a_field_of_the_recipe_config():
    layout_keys = {f.name for f in fields(LayoutSettings)}
    assert layout_keys.isdisjoint(f.name for f in fields(at.TrainConfig))


def test_a_recipe_config_that_declares_a_layout_setting_is_refused():
    @dataclass
    class Bf16ByDefault(at.TrainConfig):
        mixed_precision: str = "bf16"

    with pytest.raises(at.ConfigError, match="Bf16ByDefault declares mixed_precision, which is a layout setting"):
        resolve_settings(Bf16ByDefault)


def test_layout_keys_go_to_the_layout_and_the_rest_to_the_config_from_any_source(tmp_path):
    config_file = write_yaml(tmp_path / "run.yaml", {"max_steps": 7, "ddp_bucket_cap_mb": 5})
    cfg, layout = resolve_settings(Recipe.Config, config_file, {"mixed_precision": "bf16", "lr": "0.5"})
    assert (cfg.max_steps, cfg.lr) == (7, 0.5)
    assert (layout.ddp_bucket_cap_mb, layout.mixed_precision) == (5, "bf16")


def test_precedence_is_defaults_then_settings_file_then_config_file_then_overrides(tmp_path):
    settings = write_yaml(tmp_path / "x.settings.yaml", {"ddp_powersgd_rank": 2, "ddp_bucket_cap_mb": 2,
                                                         "collective_timeout_s": 2})  # fmt: skip
    config_file = write_yaml(tmp_path / "run.yaml", {"ddp_bucket_cap_mb": 3, "collective_timeout_s": 3})
    _, layout = resolve_settings(Recipe.Config, config_file, {"collective_timeout_s": "4"}, layout_file=settings)
    assert (layout.ddp_powersgd_rank, layout.ddp_bucket_cap_mb, layout.collective_timeout_s) == (2, 3, 4.0)
    assert layout.ddp_comm_hook == LayoutSettings().ddp_comm_hook


def test_a_recipe_key_in_a_settings_file_is_refused_with_where_it_belongs(tmp_path):
    settings = write_yaml(tmp_path / "x.settings.yaml", {"lr": 0.1})
    with pytest.raises(at.ConfigError, match="lr in .*x.settings.yaml is a recipe config key, not a layout setting"):
        resolve_settings(Recipe.Config, layout_file=settings)


def test_a_misspelled_layout_setting_is_refused_with_a_hint(tmp_path):
    settings = write_yaml(tmp_path / "x.settings.yaml", {"ddp_comm_hoook": "powersgd"})
    with pytest.raises(at.ConfigError, match="did you mean 'ddp_comm_hook'"):
        resolve_settings(Recipe.Config, layout_file=settings)


def test_layout_settings_are_range_checked_like_the_config():
    with pytest.raises(at.ConfigError, match="collective_timeout_s=0.0: must be more than 0"):
        resolve_settings(Recipe.Config, overrides={"collective_timeout_s": "0"})


def test_help_shows_the_config_and_the_layout_settings_as_two_groups(capsys):
    at.main("vae", ["--help"])
    text = capsys.readouterr().out
    config_part, layout_part = text.split("layout settings")
    assert "  max_steps=" in config_part and "mixed_precision" not in config_part
    assert "  mixed_precision=None" in layout_part and "  ddp_comm_hook='none'" in layout_part
    assert "max_steps" not in layout_part


def test_a_run_folder_records_its_config_and_its_layout_apart(tmp_path):
    at.train(
        "vae", max_steps=1, mixed_precision="bf16", output_dir=str(tmp_path), show_progress_bar=False, report=False
    )
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    layout = yaml.safe_load((tmp_path / "layout.yaml").read_text())
    assert "mixed_precision" not in config and config["max_steps"] == 1
    assert layout["mixed_precision"] == "bf16"


@pytest.mark.parametrize(
    ("plugin", "message"),
    [(SimpleNamespace(activation_checkpointing=True, state_dict_type=None), "wrap the blocks a second time"),
     (SimpleNamespace(activation_checkpointing=False, state_dict_type="FULL_STATE_DICT"), "always sharded")],
)  # fmt: skip
def test_fsdp_options_that_would_be_a_second_switch_or_do_nothing_are_refused(plugin, message):
    with pytest.raises(at.LayoutError, match=message):
        check_fsdp_options(plugin)
    check_fsdp_options(SimpleNamespace(activation_checkpointing=False, state_dict_type="SHARDED_STATE_DICT"))


@pytest.mark.multiprocess
def test_canary_accelerate_does_not_tell_workers_its_config_file(tmp_path):
    """Why a layout's settings file needs layout= (which names the file to the workers): accelerate launch's
    workers cannot tell which config it read. Fails the day accelerate names it to them."""
    config = shutil.copy(REPO / "accelerate_configs" / "cpu_ddp.yaml", tmp_path / "my_layout.yaml")
    result = run_command(
        [*ACCELERATE_LAUNCH, "--config_file", config, "--main_process_port", str(free_port()),
         WORKERS / "launch_config.py", "my_layout.yaml"],
        env=clean_env(),
    )  # fmt: skip
    assert result.stdout.count("env-mentions 0") == 2, result.stdout + result.stderr


@pytest.mark.multiprocess
def test_a_layout_file_that_names_powersgd_runs_powersgd_under_accelerate_launch_with_layout(tmp_path):
    config = shutil.copy(REPO / "accelerate_configs" / "cpu_ddp.yaml", tmp_path / "cpu_ddp_powersgd.yaml")
    write_yaml(settings_file_of(config), {"ddp_comm_hook": "powersgd", "ddp_powersgd_rank": 3,
                                          "ddp_powersgd_start_step": 2})  # fmt: skip
    out = tmp_path / "run"
    launched = run_command(
        [BIN / "accelerate", "launch", "--config_file", config, "--main_process_port", str(free_port()),
         WORKERS / "train_and_dump.py", "vae", f"output_dir={out}", f"layout={config}", *QUICK_VAE,
         *TEST_OVERRIDES],
        env=dump_env(out, 2),
    )  # fmt: skip

    assert "precision fp32, settings cpu_ddp_powersgd.settings.yaml" in launched.stdout, launched.stdout
    for rank in (0, 1):
        assert rank_summary(out, rank)["comm_hooks"] == ["powerSGD_hook rank 3"]
    assert yaml.safe_load((out / "layout.yaml").read_text())["ddp_comm_hook"] == "powersgd"

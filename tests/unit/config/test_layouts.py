"""Every accelerate config in accelerate_configs/ parses, says what it is, and is used by a Makefile target.

The CPU layouts are also run for real by tests/processes/test_multiprocess.py (cpu.yaml and cpu_ddp.yaml); the GPU
layouts are validated here against the machine their header describes.
"""

from __future__ import annotations

import re

import pytest
import yaml

from accel_trainer.config.layout import SETTINGS_SUFFIX, LayoutSettings, settings_file_of
from accel_trainer.config.train_config import resolve_settings
from accel_trainer.parallel.mesh import mesh_shape
from accel_trainer.recipe import Recipe
from conftest import REPO

CONFIGS = sorted(p for p in (REPO / "accelerate_configs").glob("*.yaml") if not p.name.endswith(SETTINGS_SUFFIX))
SETTINGS = sorted((REPO / "accelerate_configs").glob(f"*{SETTINGS_SUFFIX}"))
# file -> (distributed_type, num_processes, mixed_precision, use_cpu) that its header promises
EXPECTED = {
    "cpu.yaml": ("NO", 1, "no", True),
    "cpu_ddp.yaml": ("MULTI_GPU", 2, "no", False),
    "gpu.yaml": ("NO", 1, "bf16", False),
    "4gpu_ddp.yaml": ("MULTI_GPU", 4, "bf16", False),
    "8gpu_ddp.yaml": ("MULTI_GPU", 8, "bf16", False),
    "cpu_fsdp.yaml": ("FSDP", 2, "no", False),
    "4gpu_fsdp.yaml": ("FSDP", 4, "bf16", False),
    "8gpu_fsdp.yaml": ("FSDP", 8, "bf16", False),
    "4gpu_ddp_powersgd.yaml": ("MULTI_GPU", 4, "bf16", False),
    "2node_cpu.yaml": ("MULTI_GPU", 2, "no", False),
    "2node_4gpu.yaml": ("MULTI_GPU", 8, "bf16", False),
    "cpu_tp.yaml": ("MULTI_GPU", 2, "no", False),
    "cpu_fsdp_tp.yaml": ("FSDP", 4, "no", False),
    "cpu_hsdp.yaml": ("FSDP", 4, "no", False),
    "8gpu_fsdp_tp.yaml": ("FSDP", 8, "bf16", False),
    "2node_hsdp.yaml": ("FSDP", 8, "bf16", False),
    "cpu_pp.yaml": ("MULTI_GPU", 2, "no", False),
    "cpu_pp_fsdp.yaml": ("FSDP", 4, "no", False),
    "8gpu_pp_fsdp.yaml": ("FSDP", 8, "bf16", False),
    "8gpu_fsdp_cp.yaml": ("FSDP", 8, "bf16", False),
}
# file -> (dp_replicate, dp_shard, tp, cp) of its mesh, from its parallelism_config section or its settings file
MESHES = {
    "cpu_tp.yaml": (1, 1, 2, 1),
    "cpu_fsdp_tp.yaml": (1, 2, 2, 1),
    "cpu_hsdp.yaml": (2, 2, 1, 1),
    "8gpu_fsdp_tp.yaml": (1, 4, 2, 1),
    "2node_hsdp.yaml": (2, 4, 1, 1),
    "8gpu_fsdp_cp.yaml": (1, 4, 1, 2),
}
# file -> (pipeline stages (pp_size, from its settings file), processes per stage)
PIPELINES = {"cpu_pp.yaml": (2, 1), "cpu_pp_fsdp.yaml": (2, 2), "8gpu_pp_fsdp.yaml": (2, 4)}


def test_the_layout_folder_holds_exactly_the_known_layouts():
    assert len(CONFIGS) == 20
    assert {path.name for path in CONFIGS} == set(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_layout_parses_and_matches_what_its_header_promises(path):
    config = yaml.safe_load(path.read_text())
    distributed_type, num_processes, mixed_precision, use_cpu = EXPECTED[path.name]
    assert str(config["distributed_type"]) == distributed_type
    assert config["num_processes"] == num_processes
    assert config["mixed_precision"] == mixed_precision
    assert config["use_cpu"] is use_cpu
    header = path.read_text().split("\ncompute_environment")[0]
    assert header.startswith("# Layout:")
    assert f"accelerate launch --config_file accelerate_configs/{path.name}" in header
    first_line = header.splitlines()[0]
    assert re.search(rf"\b{num_processes}\b", first_line) or num_processes == 1
    dp_replicate, _, tp, cp = MESHES.get(path.name, (1, 1, 1, 1))
    assert ("FSDP" in first_line) == (distributed_type == "FSDP")
    pipeline = path.name in PIPELINES
    assert ("DDP" in first_line) == (distributed_type == "MULTI_GPU" and tp == 1 and not pipeline)
    assert ("tensor parallel" in first_line) == (tp > 1)
    assert ("pipeline parallel" in first_line) == pipeline
    assert ("HSDP" in first_line) == (dp_replicate > 1)
    assert ("context parallel" in first_line) == (cp > 1)
    if distributed_type == "FSDP":
        assert config["fsdp_config"]["fsdp_version"] == 2
    if "2node" in path.name:
        assert config["num_machines"] == 2 and "--machine_rank" in header


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_layout_is_accepted_by_accelerates_own_config_loader(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes == EXPECTED[path.name][1]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_layout_is_used_by_a_makefile_target_named_in_its_header(path):
    makefile = (REPO / "Makefile").read_text()
    targets = re.findall(rf"^([\w-]+):[^\n]*\n\t[^\n]*accelerate_configs/{re.escape(path.name)}", makefile, re.M)
    assert len(targets) == 1, f"no Makefile target launches {path.name}"
    assert f"make {targets[0]}" in path.read_text()


def test_each_settings_file_belongs_to_a_layout():
    assert [path.name for path in SETTINGS] == ["4gpu_ddp_powersgd.settings.yaml", "8gpu_pp_fsdp.settings.yaml",
                                                "cpu_pp.settings.yaml", "cpu_pp_fsdp.settings.yaml",
                                                "cpu_tp.settings.yaml"]  # fmt: skip


@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_mesh_layout_names_sizes_whose_product_is_its_process_count(name):
    path = REPO / "accelerate_configs" / name
    config = yaml.safe_load(path.read_text())
    dp_replicate, dp_shard, tp, cp = MESHES[name]
    assert dp_replicate * dp_shard * tp * cp == config["num_processes"]
    if config["distributed_type"] == "FSDP":  # accelerate's launcher carries the sizes
        section = config["parallelism_config"]
        assert section["parallelism_config_dp_replicate_size"] == dp_replicate
        assert section["parallelism_config_dp_shard_size"] == dp_shard
        assert section["parallelism_config_tp_size"] == tp
        assert section.get("parallelism_config_cp_size", 1) == cp
    else:  # accelerate refuses a parallelism_config without FSDP: our settings file carries tp_size
        settings = yaml.safe_load(settings_file_of(path).read_text())
        assert settings == {"tp_size": tp}
    assert all(path in map(settings_file_of, CONFIGS) for path in SETTINGS)


@pytest.mark.parametrize("path", SETTINGS, ids=lambda p: p.name)
def test_settings_file_holds_valid_layout_settings_and_differs_from_the_defaults(path):
    _, layout = resolve_settings(Recipe.Config, layout_file=path)
    assert layout != LayoutSettings()


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_pipeline_layout_runs_its_stages_on_all_its_processes(name):
    path = REPO / "accelerate_configs" / name
    _, layout = resolve_settings(Recipe.Config, layout_file=settings_file_of(path))
    config = yaml.safe_load(path.read_text())
    stages, per_stage = PIPELINES[name]
    assert layout.pp_size == stages and stages * per_stage == config["num_processes"]
    shape = mesh_shape(layout, config["num_processes"], config["distributed_type"] == "FSDP")
    assert (shape.pp, shape.dp_shard) == (stages, per_stage)


def test_the_powersgd_layout_names_powersgd():
    _, layout = resolve_settings(Recipe.Config, layout_file=settings_file_of(REPO / "accelerate_configs" /
                                                                            "4gpu_ddp_powersgd.yaml"))  # fmt: skip
    assert (layout.ddp_comm_hook, layout.ddp_powersgd_rank) == ("powersgd", 4)

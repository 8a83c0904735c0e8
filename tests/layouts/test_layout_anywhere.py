"""`layout=NAME|FILE` travels with the run: a worker that torchrun (or srun, a Kubernetes job, Ray) started reads
the accelerate config itself and trains exactly as under `accelerate launch --config_file`, which
`accel-trainer train NAME layout=L` runs when no launcher started it (parallel/layout_file.py). Bitwise on
cpu_fsdp (accel-trainer train layout= against torchrun layout=), cpu_tp and cpu_pp (torchrun layout= against the
layout's accelerate launch); the torchrun runs start the recipe file itself (`torchrun recipes/gpt.py`)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import accel_trainer as at
from accel_trainer import LayoutError
from accel_trainer.parallel.layout_file import (
    LAYOUT_VARIABLE,
    OPTIONS_VARIABLE,
    apply_layout,
    launch_layout,
    layout_environment,
    read_layout,
)
from conftest import REPO, clean_env, final_parameters, free_port, run_command, train_and_dump

TINY_GPT = ["n_layer=2", "d_model=32", "n_head=2", "block_size=32", "max_steps=3", "max_source_bytes=100000",
            "eval_every_steps=0", "show_progress_bar=false", "report=false"]  # fmt: skip


def torchrun_with_layout(layout: str, out) -> str:
    """torchrun of the GPT recipe file, the layout named only by `layout=`; what it printed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), REPO / "recipes" / "gpt.py", f"layout={layout}", f"output_dir={out}",
               *TINY_GPT]  # fmt: skip
    return run_command(command, env=clean_env()).stdout


def assert_same_weights(one, other) -> None:
    expected, actual = final_parameters(one), final_parameters(other)
    assert expected.keys() == actual.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


@pytest.mark.multiprocess
def test_torchrun_with_layout_trains_bitwise_as_accelerate_launch_of_that_config(tmp_path):
    # tensor parallel: its tp_size comes from the layout's settings file, as a pipeline's pp_size does (both read
    # by the same LayoutSettings; unit/config/test_layouts.py checks every shipped layout's)
    # the baseline: a scenario of the layout's own `accelerate launch --config_file` (conftest's LayoutLaunches)
    train_and_dump("cpu_tp", tmp_path / "accelerate", "gpt", *TINY_GPT, world_size=2)
    printed = torchrun_with_layout("cpu_tp", tmp_path / "torchrun")

    assert "layout: 2 process(es) on cpu, tensor parallel" in printed  # torchrun alone would have been DDP
    assert_same_weights(tmp_path / "accelerate", tmp_path / "torchrun")


@pytest.mark.multiprocess
def test_accel_trainer_train_with_layout_starts_its_processes_and_equals_torchrun_with_layout(tmp_path):
    out = tmp_path / "self_launched"
    command = [sys.executable, "-m", "accel_trainer", "train", "gpt", "layout=cpu_fsdp", f"output_dir={out}",
               *TINY_GPT, "--", "--main_process_port", str(free_port())]  # fmt: skip
    printed = run_command(command, env=clean_env()).stdout
    torchrun_with_layout("cpu_fsdp", tmp_path / "torchrun")

    assert "layout: 2 process(es) on cpu, FSDP2" in printed
    assert_same_weights(out, tmp_path / "torchrun")


def test_a_layout_reads_as_accelerate_launch_would_set_its_workers_variables():
    fsdp, hsdp = read_layout("cpu_fsdp"), read_layout(str(REPO / "accelerate_configs" / "cpu_hsdp.yaml"))

    assert fsdp.num_processes == 2 and fsdp.environment["ACCELERATE_USE_FSDP"] == "true"
    assert fsdp.environment["FSDP_VERSION"] == "2"
    assert hsdp.num_processes == 4 and hsdp.environment["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
    assert "MASTER_PORT" not in fsdp.environment and "OMP_NUM_THREADS" not in fsdp.environment


def test_a_launch_of_another_size_or_with_another_config_is_a_one_line_refusal(monkeypatch, environment_restored):
    fsdp = read_layout("cpu_fsdp")
    with pytest.raises(LayoutError, match=r"layout=cpu_fsdp.yaml is 2 process\(es\) but this launch started 4"):
        apply_layout(fsdp, launched_processes=4)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    with pytest.raises(
        LayoutError, match="the launcher set ACCELERATE_USE_FSDP=false and layout=cpu_fsdp.yaml says true"
    ):
        apply_layout(fsdp, launched_processes=2)


def layout_variables() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_", LAYOUT_VARIABLE))
    }


def test_a_run_no_launcher_started_gets_the_layout_and_the_next_run_starts_without_it(tmp_path):
    before = layout_variables()
    with layout_environment(read_layout("cpu_fsdp")):
        assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ[LAYOUT_VARIABLE].endswith("cpu_fsdp.yaml")
    assert layout_variables() == before

    result = at.train("mlp", layout="cpu", max_steps=2, output_dir=str(tmp_path), show_progress_bar=False, report=False)
    assert result.metrics["step"] == 2 and layout_variables() == before


@pytest.fixture
def environment_restored():
    """apply_layout sets the layout's variables for the rest of the process, as a worker wants: not this one's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_launcher_options_are_part_of_the_layout_its_workers_read_them_too(monkeypatch, environment_restored):
    sized = read_layout("cpu_fsdp", ["--num_processes", "4", "--mixed_precision", "bf16"])
    assert sized.num_processes == 4 and sized.environment["ACCELERATE_MIXED_PRECISION"] == "bf16"

    # a worker of that launch: the launcher's variables, and its options named in the environment
    monkeypatch.setenv(OPTIONS_VARIABLE, json.dumps(sized.options))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    apply_layout(read_layout("cpu_fsdp"), launched_processes=4)  # not refused: the same layout
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"


def test_launcher_options_accelerate_refuses_and_a_machine_without_its_rank_are_one_line_errors():
    with pytest.raises(LayoutError, match="accelerate can launch: .*unrecognized arguments: --num_gpus_please"):
        read_layout("cpu_fsdp", ["--num_gpus_please", "4"])
    with pytest.raises(LayoutError, match="layout=2node_cpu.yaml is 2 machines: run the command on each, with"):
        launch_layout(read_layout("2node_cpu"), ["-m", "accel_trainer", "train", "mlp"])


def test_canary_torchs_launcher_forwards_no_sigusr1_to_its_workers_unless_told():
    """Slurm's `--signal` warning is SIGUSR1, which torch's agent does not pass on to its workers (they are in a
    session of their own) unless told: processes._launcher_defaults tells it. Fails the day torch's default
    includes it, and the setting can go."""
    from torch.distributed.run import get_args_parser

    assert "SIGUSR1" not in get_args_parser().parse_args(["x.py"]).signals_to_handle


def test_a_deepspeed_layout_which_layout_cannot_apply_in_the_workers_is_a_one_line_refusal(tmp_path):
    config = tmp_path / "zero2.yaml"
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 2}\nnum_processes: 2\n")
    with pytest.raises(LayoutError, match="is a DeepSpeed config, which layout= cannot apply in the workers"):
        read_layout(str(config))

"""Why each launch workaround in accel_trainer/parallel/launch_fixes.py exists, and that it holds.

The launch traps are shown for real in test_multiprocess.py; these are the in-process checks.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from accel_trainer import LayoutError
from accel_trainer.parallel import launch_fixes
from conftest import REPO, train_and_dump


def test_a_world_smaller_than_the_launcher_started_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LayoutError, match="started 2 processes but each sees a world of 1"):
        launch_fixes.check_launched_world(1)
    launch_fixes.check_launched_world(2)


@pytest.mark.parametrize("use_cpu", ["True", "False"])  # False: a MULTI_CPU config with use_cpu: false
def test_a_single_process_started_for_a_multi_process_cpu_launch_is_refused(monkeypatch, use_cpu):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", use_cpu)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(LayoutError, match="cpu_ddp.yaml"):
        launch_fixes.refuse_single_process_cpu_launch()
    monkeypatch.delenv("MASTER_ADDR")
    launch_fixes.refuse_single_process_cpu_launch()  # a 1-process CPU launch is fine


def test_canary_a_second_accelerator_with_another_precision_needs_a_state_reset():
    """accelerate's AcceleratorState is a singleton; when this stops raising, forget_accelerate_state can go."""
    Accelerator(cpu=True, mixed_precision="no")
    with pytest.raises(ValueError, match="restart your runtime"):
        Accelerator(cpu=True, mixed_precision="bf16")

    launch_fixes.forget_accelerate_state()

    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"


def test_canary_accelerates_ram_efficient_fsdp2_loading_reties_weights_only_through_tie_weights():
    """Why load_weights_on_every_process exists: FSDP2's cpu_ram_efficient_loading moves the model to the meta
    device and re-ties weights only by calling a transformers-style `tie_weights()`, so a plain model's tied
    LM head and embedding come back untied (they trained apart: the GPT's step-1 gradient norm 2.05, not 2.22).
    When accelerate re-ties weights for any model, this fails and the workaround can go."""
    from accelerate.utils import fsdp_utils

    source = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert 'model = model.to(torch.device("meta"))' in source
    assert 'if hasattr(model, "tie_weights"):' in source


class TiedLinear(torch.nn.Module):
    """An embedding and a head sharing one weight, as a plain module ties them (no `tie_weights()`)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embedding.weight


class TiedLinearThatReties(TiedLinear):
    def tie_weights(self):
        self.head.weight = self.embedding.weight


def test_accelerates_broadcast_is_known_to_keep_a_model_whole_unless_it_ties_without_tie_weights_or_has_buffers():
    assert launch_fixes.broadcastable(TiedLinearThatReties())
    assert launch_fixes.broadcastable(torch.nn.Linear(3, 4))
    assert not launch_fixes.broadcastable(TiedLinear())  # its tie would be lost
    assert not launch_fixes.broadcastable(torch.nn.BatchNorm1d(3))  # its statistics are buffers in the state dict


def test_canary_accelerates_ram_efficient_fsdp2_loading_looks_entries_up_with_a_transformers_method():
    """Why fsdp_loading keeps RAM-efficient loading for transformers models only: accelerate reads each entry with
    `model.get_parameter_or_buffer` (transformers'), whose fallback fails on a plain module's top-level parameter
    ('FSDPLinear' object has no attribute 'get_parameter_or_buffer'). When that changes, this fails."""
    from accelerate.utils import fsdp_utils

    assert "model.get_parameter_or_buffer(param_name)" in inspect.getsource(fsdp_utils.fsdp2_load_full_state_dict)
    assert not hasattr(torch.nn.Module, "get_parameter_or_buffer")


def test_canary_accelerates_ram_efficient_fsdp2_loading_takes_every_state_dict_entry_for_a_sharded_parameter():
    """Why a model with buffers in its state dict (BatchNorm) loads on every process: accelerate's broadcast reads
    `device_mesh` of each entry, which a buffer FSDP left unsharded has not ('Tensor' object has no attribute
    'device_mesh'). When accelerate skips or broadcasts buffers, this fails and `broadcastable` can drop it."""
    from accelerate.utils import fsdp_utils

    source = inspect.getsource(fsdp_utils.fsdp2_load_full_state_dict)
    assert "device_mesh = sharded_param.device_mesh" in source
    assert "for param_name, sharded_param in meta_sharded_sd.items():" in source


@pytest.mark.multiprocess
def test_an_fsdp_config_with_ram_efficient_loading_trains_tied_weights_like_one_that_turns_it_off(tmp_path):
    shipped = (REPO / "accelerate_configs" / "cpu_fsdp.yaml").read_text()
    assert "fsdp_cpu_ram_efficient_loading: true" in shipped
    off = shipped.replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false")
    (tmp_path / "fsdp_loading_off.yaml").write_text(off)
    gpt = ["n_layer=1", "d_model=32", "block_size=32", "max_steps=2", "global_batch_size=8", "micro_batch_size=4",
           "log_every_steps=1", "eval_every_steps=0", "max_source_bytes=100000"]  # fmt: skip
    norms = []
    for config in ("cpu_fsdp", str(tmp_path / "fsdp_loading_off")):  # a layout's name, or a layout file's path
        records = train_and_dump(config, tmp_path / Path(config).name, "gpt", *gpt, world_size=2)
        norms.append([r["grad_norm"] for r in records if "grad_norm" in r])
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)


def test_canary_the_accelerate_command_imports_transformers_and_its_launch_module_does_not():
    """Why the doctor and the test suite launch with `python -m accelerate.commands.launch`."""
    script = (
        "import sys, importlib\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    print('transformers' in sys.modules)\n"
    )
    modules = ["accelerate.commands.launch", "accelerate.commands.accelerate_cli"]  # the launch module first
    result = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "True"], result.stderr

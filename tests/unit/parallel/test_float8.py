"""`mixed_precision=fp8` (accel_trainer/parallel/float8.py): accepted where float8 can train, through accelerate's
torchao recipe; refused in one line, with the reason, everywhere else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.errors import LayoutError
from accel_trainer.parallel import float8
from accel_trainer.parallel.layout_file import read_layout

FP8 = LayoutSettings(mixed_precision="fp8")


def a_gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)


def test_fp8_is_refused_without_a_cuda_gpu_with_the_reason_and_what_to_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LayoutError, match="compute capability 8.9 or newer .* no CUDA GPU: use mixed_precision=bf16"):
        float8.check_float8(FP8)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # the accelerate config's, with no layout setting
    with pytest.raises(LayoutError, match="no CUDA GPU"):
        float8.check_float8(LayoutSettings())
    float8.check_float8(LayoutSettings(mixed_precision="bf16"))  # the setting wins over the launcher's


def test_fp8_is_refused_on_a_gpu_without_float8_tensor_cores(monkeypatch):
    a_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(LayoutError, match=r"NVIDIA A100-SXM4-80GB is 8.0: use mixed_precision=bf16"):
        float8.check_float8(FP8)


def test_fp8_on_a_hopper_gpu_takes_accelerates_torchao_recipe_and_refuses_what_accelerate_cannot(monkeypatch):
    a_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    pytest.importorskip("torchao")
    float8.check_float8(FP8)
    from accelerate.utils import AORecipeKwargs

    assert [type(handler) for handler in float8.float8_handlers(FP8)] == [AORecipeKwargs]
    assert float8.float8_handlers(LayoutSettings(mixed_precision="bf16")) == []
    with pytest.raises(LayoutError, match="set fsdp_cpu_ram_efficient_loading: false"):
        float8.check_float8(FP8, SimpleNamespace(cpu_ram_efficient_loading=True))
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "TE")
    with pytest.raises(LayoutError, match="backend TE: accel-trainer trains fp8 through torchao"):
        float8.check_float8(FP8)


def test_canary_accelerate_reads_an_fp8_config_into_the_variables_float8_reads(tmp_path):
    """parallel/float8.py reads ACCELERATE_MIXED_PRECISION and ACCELERATE_FP8_BACKEND, the variables accelerate's
    launch code makes of `mixed_precision: fp8` and `fp8_config: {backend: AO}`; and AORecipeKwargs keeps the
    fields its docstring names. When this fails, accelerate renamed them: follow it in float8.py."""
    config = tmp_path / "fp8.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_machines: 1\nnum_processes: 1\n"
        "machine_rank: 0\nuse_cpu: true\nmixed_precision: fp8\nfp8_config:\n  backend: AO\ndynamo_config: {}\n"
    )
    environment = read_layout(str(config)).environment
    assert environment["ACCELERATE_MIXED_PRECISION"] == "fp8" and environment["ACCELERATE_FP8_BACKEND"] == "AO"
    assert environment["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] == "1"
    from accelerate.utils import AORecipeKwargs

    assert {"config", "module_filter_func", "pad_inner_dim", "enable_fsdp_float8_all_gather"} <= set(
        AORecipeKwargs.__dataclass_fields__
    )


def converted(handler) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A model whose inner linear layers accelerate converts to float8 as `prepare` does, and its parameters as
    an optimizer built before `prepare` holds them."""
    from accelerate.utils.ao import convert_model_to_fp8_ao

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    before = list(model.parameters())
    convert_model_to_fp8_ao(model, config=handler.config, module_filter_func=handler.module_filter_func)
    assert type(model[1]).__name__ == "Float8Linear"
    return model, before


def test_canary_accelerates_default_fp8_recipe_replaces_the_weights_an_optimizer_built_before_prepare_holds():
    pytest.importorskip("torchao")
    from accelerate.utils import AORecipeKwargs

    model, before = converted(AORecipeKwargs())  # float8 all-gather on, FSDP or not: new Parameters
    held = {id(parameter) for parameter in model.parameters()}
    assert sum(id(parameter) not in held for parameter in before) == 2  # the two inner layers' weights
    optimizer = torch.optim.AdamW(before)
    with pytest.raises(LayoutError, match=r"steps a \(32, 32\) parameter that the float8 model no longer holds"):
        float8.check_optimizers_hold_the_model(model, [optimizer])


@pytest.mark.parametrize("fsdp", [False, True], ids=["one-process-or-ddp", "fsdp2"])
def test_the_fp8_recipe_gathers_in_float8_under_fsdp2_alone_so_the_optimizer_keeps_the_models_parameters(fsdp):
    pytest.importorskip("torchao")
    (handler,) = float8.float8_handlers(FP8, SimpleNamespace() if fsdp else None)
    assert handler.config.enable_fsdp_float8_all_gather is fsdp
    if not fsdp:  # under FSDP2 accelerate maps the optimizer to the new parameters by storage when it shards
        model, before = converted(handler)
        float8.check_optimizers_hold_the_model(model, [torch.optim.AdamW(before)])

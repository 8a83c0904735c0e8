"""The loop's step verbs: accelerate's where they do work that matters, torch's directly elsewhere, same results."""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from accel_trainer import LayoutError
from accel_trainer.parallel.accelerator import check_supported
from accel_trainer.parallel.verbs import StepVerbs, clip_one_group, discard_step, step_optimizers
from conftest import reset_accelerate_state


@pytest.fixture
def prepared():
    reset_accelerate_state()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    yield accelerator, model, optimizer
    reset_accelerate_state()


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _train_two_steps(verbs: StepVerbs, model) -> list[torch.Tensor]:
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4)
    norms = []
    for _ in range(2):
        for micro_batch in inputs.split(4):
            verbs.backward(model(micro_batch).square().mean())
        norms.append(verbs.clip_grad_norm(0.5))
        assert verbs.optimizer_step()
        verbs.zero_grad()
    return norms


def test_canary_accelerated_optimizer_step_searches_installed_packages_on_every_call(monkeypatch, prepared):
    """The overhead the direct path avoids; when this fails, accelerate dropped its per-step search."""
    _, model, optimizer = prepared
    model(torch.ones(2, 4)).sum().backward()
    calls = _count_calls(monkeypatch, importlib.util, "find_spec")
    optimizer.step()
    assert len(calls) >= 1


def test_direct_verbs_do_no_package_search_or_signature_inspection(monkeypatch, prepared):
    accelerator, model, optimizer = prepared
    verbs = StepVerbs(accelerator, optimizer, list(model.parameters()))
    searches = _count_calls(monkeypatch, importlib.util, "find_spec")
    inspections = _count_calls(monkeypatch, inspect, "signature")
    before = model[0].weight.detach().clone()

    _train_two_steps(verbs, model)

    assert verbs.direct and searches == [] and inspections == []
    assert not torch.equal(model[0].weight, before)
    assert optimizer.optimizer.state[model[0].weight]["step"] == 2
    assert model[0].weight.grad is None


def test_direct_verbs_train_bit_identically_to_accelerates_verbs(prepared):
    accelerator, model, optimizer = prepared
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    direct = StepVerbs(accelerator, optimizer, list(model.parameters()))
    direct_norms = _train_two_steps(direct, model)
    direct_weights = {name: value.clone() for name, value in model.state_dict().items()}

    model.load_state_dict(initial)
    optimizer.optimizer.state.clear()
    through_accelerate = StepVerbs(accelerator, optimizer, list(model.parameters()))
    through_accelerate.direct = False
    accelerate_norms = _train_two_steps(through_accelerate, model)

    assert [n.item() for n in direct_norms] == [n.item() for n in accelerate_norms]
    assert all(torch.equal(model.state_dict()[name], direct_weights[name]) for name in direct_weights)


def _gradients_of_a_small_mlp(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    model(torch.randn(4, 6)).square().mean().backward()
    model[2].bias.grad = None  # a parameter without a gradient is passed over, as torch does
    return list(model.parameters())


@pytest.mark.parametrize("max_norm", [1e-3, 1e6, float("inf")])
def test_clipping_one_group_is_torchs_clip_grad_norm_bit_for_bit(max_norm):
    """Clipping active (1e-3), a no-op factor (1e6), and only measuring (inf)."""
    torch_parameters, ours = _gradients_of_a_small_mlp(), _gradients_of_a_small_mlp()

    torch_norm = torch.nn.utils.clip_grad_norm_(torch_parameters, max_norm)
    our_norm = clip_one_group(ours, max_norm)

    assert torch.equal(our_norm, torch_norm)
    for theirs, mine in zip(torch_parameters, ours, strict=True):
        assert (theirs.grad is None and mine.grad is None) or torch.equal(theirs.grad, mine.grad)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_clipping_one_group_of_non_finite_gradients_is_torchs_too(poison):
    torch_parameters, ours = _gradients_of_a_small_mlp(), _gradients_of_a_small_mlp()
    for parameters in (torch_parameters, ours):
        parameters[0].grad[0, 0] = poison

    torch_norm = torch.nn.utils.clip_grad_norm_(torch_parameters, 1.0)
    our_norm = clip_one_group(ours, 1.0)

    assert torch.equal(our_norm, torch_norm) or (our_norm.isnan() and torch_norm.isnan())
    for theirs, mine in zip(torch_parameters, ours, strict=True):
        assert (theirs.grad is None and mine.grad is None) or torch.equal(theirs.grad.isnan(), mine.grad.isnan())


@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["one group", "two dtypes"])
def test_without_clipping_the_direct_verbs_only_measure_even_a_non_finite_norm(prepared, mixed_dtypes):
    """torch's clip at max_norm inf would multiply every gradient by NaN here."""
    accelerator, _, optimizer = prepared
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1).double() if mixed_dtypes else
                                torch.nn.Linear(2, 1))  # fmt: skip
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    model[0].weight.grad[0, 0] = float("inf")
    before = [parameter.grad.clone() for parameter in model.parameters()]

    verbs = StepVerbs(accelerator, optimizer, list(model.parameters()))
    norm = verbs.clip_grad_norm(float("inf"))

    assert verbs.one_group is not mixed_dtypes and norm.isinf()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_clipping_one_group_of_no_gradients_is_torchs_zero_norm():
    parameters = [torch.nn.Parameter(torch.ones(3))]
    assert torch.equal(clip_one_group(parameters, 1.0), torch.nn.utils.clip_grad_norm_(parameters, 1.0))


def test_parameters_of_two_dtypes_are_clipped_by_torch_itself(prepared):
    accelerator, _, optimizer = prepared
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1).double())
    assert not StepVerbs(accelerator, optimizer, list(mixed.parameters())).one_group
    assert StepVerbs(accelerator, optimizer, list(torch.nn.Linear(2, 1).parameters())).one_group


def test_canary_torchs_clip_grad_norm_groups_the_gradients_on_every_call(monkeypatch):
    """The per-call work `clip_one_group` avoids; when this fails, torch stopped grouping on each call: measure
    `benchmarks/overhead.py` (b) with torch's clip and drop the shortcut if it no longer pays."""
    calls = _count_calls(monkeypatch, torch.nn.utils.clip_grad, "_group_tensors_by_device_and_dtype")
    torch.nn.utils.clip_grad_norm_(_gradients_of_a_small_mlp(), 1.0)
    assert len(calls) >= 2  # once for the norm, once for the scaling


@pytest.mark.parametrize(
    ("distributed_type", "has_scaler", "direct"),
    [(DistributedType.NO, False, True), (DistributedType.MULTI_CPU, False, True),
     (DistributedType.MULTI_GPU, False, True), (DistributedType.MULTI_GPU, True, False),
     (DistributedType.FSDP, False, False), (DistributedType.NO, True, False)],
)  # fmt: skip
def test_accelerates_verbs_are_kept_for_a_gradient_scaler_and_for_sharded_gradients(
    distributed_type, has_scaler, direct
):
    accelerator = SimpleNamespace(scaler=object() if has_scaler else None, distributed_type=distributed_type)
    assert StepVerbs(accelerator, None, list(torch.nn.Linear(2, 1).parameters())).direct is direct  # type: ignore[arg-type]


@pytest.mark.parametrize("distributed_type", [DistributedType.DEEPSPEED, DistributedType.XLA,
                                              DistributedType.MEGATRON_LM])  # fmt: skip
def test_layouts_the_loop_does_not_drive_exactly_are_a_one_line_error(distributed_type):
    with pytest.raises(LayoutError, match="not with .*FSDP one"):
        check_supported(distributed_type)


def _fp16_like_optimizer(fused: bool, scaler: torch.amp.GradScaler | None = None, optimizer_cls=torch.optim.AdamW):
    """An AcceleratedOptimizer stepping through a gradient scaler, as accelerate builds it for fp16 on a GPU
    (torch's GradScaler runs on the CPU too), and a StepVerbs over it."""
    if scaler is None:
        reset_accelerate_state()
        Accelerator(cpu=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = torch.nn.Linear(4, 2)
    optimizer = AcceleratedOptimizer(optimizer_cls(model.parameters(), lr=0.1, fused=fused), False, scaler)
    accelerator = SimpleNamespace(scaler=scaler, distributed_type=DistributedType.MULTI_GPU)
    return model, optimizer, StepVerbs(accelerator, optimizer, list(model.parameters()))  # type: ignore[arg-type]


def _gradients(model, optimizer, value: float) -> None:
    """A scaled backward, as `accelerator.backward` does under fp16, then every gradient `value` (scaled)."""
    optimizer.scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    for parameter in model.parameters():
        parameter.grad.fill_(value * optimizer.scaler.get_scale())


def test_canary_accelerate_reports_a_fused_optimizers_skipped_fp16_step_as_taken():
    """Why StepVerbs reads the skip from the loss scale; when this fails, `step_was_skipped` can be trusted."""
    model, optimizer, _ = _fp16_like_optimizer(fused=True)
    before = model.weight.detach().clone()
    _gradients(model, optimizer, float("inf"))
    optimizer.step()
    assert torch.equal(model.weight, before) and optimizer.scaler.get_scale() == 512.0  # skipped in the kernel
    assert optimizer.step_was_skipped is False
    reset_accelerate_state()


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_the_fp16_scaler_skips_is_reported_skipped_and_a_finite_one_taken(fused):
    model, optimizer, verbs = _fp16_like_optimizer(fused)
    before = model.weight.detach().clone()
    _gradients(model, optimizer, float("nan"))
    assert verbs.optimizer_step() is False and torch.equal(model.weight, before)
    _gradients(model, optimizer, 1.0)
    assert verbs.optimizer_step() is True and not torch.equal(model.weight, before)
    reset_accelerate_state()


def test_two_optimizers_on_one_fp16_scaler_each_step_on_their_gradients_unscaled_once():
    # The gradient norm unscales every optimizer's gradients first; accelerate's step then updated the scale
    # after the first optimizer, and the second unscaled its gradients a second time (1024 times too small).
    first, first_optimizer, first_verbs = _fp16_like_optimizer(False, optimizer_cls=torch.optim.SGD)
    scaler = first_optimizer.scaler
    second, _, second_verbs = _fp16_like_optimizer(False, scaler, optimizer_cls=torch.optim.SGD)
    weights = [model.weight.detach().clone() for model in (first, second)]
    loss = first(torch.ones(1, 4)).sum() + second(torch.ones(1, 4)).sum()
    scaler.scale(loss).backward()
    for verbs in (first_verbs, second_verbs):
        scaler.unscale_(verbs.optimizer.optimizer)

    assert step_optimizers([first_verbs, second_verbs]) == [True, True]
    for model, before in zip((first, second), weights, strict=True):
        torch.testing.assert_close(model.weight, before - 0.1, rtol=0, atol=1e-7)  # SGD: lr x a gradient of 1
    assert scaler.get_scale() == 1024.0
    reset_accelerate_state()


def test_under_fp16_an_optimizer_whose_parameters_got_no_gradient_is_left_alone_and_the_other_steps():
    # torch's scaler refused it ("No inf checks were recorded for this optimizer"): a phase that trains one model
    first, first_optimizer, first_verbs = _fp16_like_optimizer(False, optimizer_cls=torch.optim.SGD)
    scaler = first_optimizer.scaler
    second, _, second_verbs = _fp16_like_optimizer(False, scaler, optimizer_cls=torch.optim.SGD)
    weights = [model.weight.detach().clone() for model in (first, second)]
    scaler.scale(first(torch.ones(1, 4)).sum()).backward()

    assert step_optimizers([first_verbs, second_verbs]) == [True, True]
    torch.testing.assert_close(first.weight, weights[0] - 0.1, rtol=0, atol=1e-7)
    assert torch.equal(second.weight, weights[1])
    reset_accelerate_state()


def test_a_step_the_nonfinite_guard_rejects_drops_every_optimizers_gradients_and_leaves_the_scaler_ready():
    # The gradient norm unscaled both optimizers' gradients; without closing the scaler's step, the next step's
    # unscale raised "unscale_() has already been called", and the second optimizer kept its NaN gradients.
    first, first_optimizer, first_verbs = _fp16_like_optimizer(False, optimizer_cls=torch.optim.SGD)
    scaler = first_optimizer.scaler
    second, _, second_verbs = _fp16_like_optimizer(False, scaler, optimizer_cls=torch.optim.SGD)
    scaler.scale(first(torch.ones(1, 4)).sum() * float("nan") + second(torch.ones(1, 4)).sum()).backward()
    for verbs in (first_verbs, second_verbs):
        scaler.unscale_(verbs.optimizer.optimizer)

    discard_step([first_verbs, second_verbs])

    assert all(p.grad is None for model in (first, second) for p in model.parameters())
    assert scaler.get_scale() == 512.0  # backed off: the inf was found
    scaler.scale(first(torch.ones(1, 4)).sum() + second(torch.ones(1, 4)).sum()).backward()
    assert step_optimizers([first_verbs, second_verbs]) == [True, True]  # the next step unscales and steps
    reset_accelerate_state()

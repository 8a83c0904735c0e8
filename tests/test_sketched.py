"""The sketched recipe (recipes/sketched.py): its fixed random sketching matrices are a function of the seed
alone, the same on every process and layout, never trained, carried whole through FSDP, checkpoints, resumes
and exports; and its defaults reach the quality the README states with under a third of the dense `mlp`'s
parameters.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.checkpoint.export import export
from accel_trainer.config.train_config import resolve_config
from conftest import (
    SAVE_ALL,
    as_kwargs,
    assert_same_run,
    checkpoint,
    final_parameters,
    rank_buffers,
    rank_summary,
    read_metrics,
    train_and_dump,
)

SKETCHES = ["0.sketch_in", "0.sketch_out", "2.sketch_in", "2.sketch_out"]
RESUMABLE = [*SAVE_ALL, "save_every_steps=15"]  # 30 steps with a checkpoint at 15: resume 15 -> 30


def build(recipe: str = "sketched", **overrides) -> torch.nn.Module:
    """The recipe's model as the loop builds it, in this process."""
    recipe_cls = at.get_recipe(recipe)
    cfg = resolve_config(recipe_cls.Config, overrides=overrides)
    return recipe_cls(cfg).build_model(cfg)


def sketches(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights.items() if ".sketch_" in name}


def assert_seed_built(weights: dict[str, torch.Tensor]) -> None:
    """The sketching matrices in `weights` are bitwise those a fresh 1-process build with the default seed makes."""
    expected = dict(build().named_buffers())
    found = sketches(weights)
    assert sorted(found) == SKETCHES
    assert all(torch.equal(found[name], expected[name]) for name in SKETCHES)


def test_the_sketching_matrices_are_untrained_buffers_drawn_from_the_seed_alone():
    torch.manual_seed(1)
    first = build(seed=0)
    torch.manual_seed(2)  # another global RNG state: the trained factors start elsewhere, the sketches do not
    second, other_seed = build(seed=0), build(seed=1)

    buffers, again, other = (dict(model.named_buffers()) for model in (first, second, other_seed))
    assert sorted(buffers) == SKETCHES
    assert all(torch.equal(buffers[name], again[name]) for name in SKETCHES)
    assert not any(torch.equal(buffers[name], other[name]) for name in SKETCHES)
    assert not torch.equal(first.state_dict()["0.left"], second.state_dict()["0.left"])
    assert not any(buffer.requires_grad for buffer in buffers.values())
    assert not {id(buffer) for buffer in buffers.values()} & {id(p) for p in first.parameters()}
    assert set(SKETCHES) <= set(first.state_dict())  # persistent: checkpoints and final weights carry them


def test_a_sketched_layers_weight_is_the_mean_over_terms_of_products_through_its_sketches():
    layer = build(num_terms=3, low_rank=2)[0]
    k, terms = 2, range(3)
    for sketch in (layer.sketch_in, layer.sketch_out):  # scaled signs
        torch.testing.assert_close(sketch.abs(), torch.full_like(sketch, k**-0.5))
    term_weights = [(layer.left[:, i * k : (i + 1) * k] @ layer.sketch_out[i * k : (i + 1) * k]
                     + layer.sketch_in[:, i * k : (i + 1) * k] @ layer.right[i * k : (i + 1) * k]) / 2
                    for i in terms]  # fmt: skip
    x = torch.rand(5, 64)

    expected = x @ torch.stack(term_weights).mean(dim=0) + layer.bias
    torch.testing.assert_close(layer(x), expected)


def test_the_sketched_mlp_reaches_096_eval_accuracy_on_a_shortened_run_with_under_a_third_of_the_mlps_parameters(
    tmp_path,
):
    at.train("sketched", max_steps=300, eval_every_steps=300, log_every_steps=300, show_progress_bar=False,
             report=False, output_dir=str(tmp_path))  # fmt: skip

    evaluations = [r for r in read_metrics(tmp_path) if "eval/accuracy" in r]
    assert evaluations[0]["step"] == 0 and evaluations[0]["eval/accuracy"] < 0.3
    assert evaluations[-1]["step"] == 300 and evaluations[-1]["eval/accuracy"] >= 0.96
    count = sum(p.numel() for p in build().parameters())
    assert count == 2_778 and 3 * count < sum(p.numel() for p in build("mlp").parameters()) == 9_610


def test_one_process_resume_is_bitwise_identical_and_every_saved_copy_holds_the_seed_built_sketches(tmp_path):
    kwargs = dict(show_progress_bar=False, report=False, **as_kwargs(RESUMABLE))
    at.train("sketched", output_dir=str(tmp_path / "full"), **kwargs)
    at.train("sketched", output_dir=str(tmp_path / "resumed"), resume=str(checkpoint(tmp_path / "full", 15)), **kwargs)

    assert_same_run(tmp_path / "full", tmp_path / "resumed", 15)
    assert_seed_built(load_file(str(checkpoint(tmp_path / "full", 15) / "model.safetensors")))
    assert_seed_built(final_parameters(tmp_path / "resumed"))
    assert_seed_built(load_file(str(export(tmp_path / "resumed", tmp_path / "export") / "model.safetensors")))


@pytest.fixture(scope="module", params=["cpu_fsdp", "cpu_ddp"])
def two_process_run(request, tmp_path_factory):
    """30 steps, a checkpoint at 15. FSDP is the layout that would show per-process sketches (a rank-dependent
    seed fails this test there); DDP broadcasts rank 0's buffers at every forward, which would hide them."""
    out = tmp_path_factory.mktemp(request.param)
    train_and_dump(request.param, out, "sketched", *RESUMABLE, world_size=2)
    return request.param, out


@pytest.mark.multiprocess
def test_every_process_holds_the_seed_built_sketches_whole_and_fsdp_shards_only_the_trained_factors(two_process_run):
    layout, out = two_process_run
    names = sorted(name for name, _ in build().named_parameters())

    for rank in (0, 1):
        assert_seed_built(rank_buffers(out, rank))
        summary = rank_summary(out, rank)
        assert summary["sharded_buffers"] == []
        if layout == "cpu_fsdp":  # every factor and bias split evenly in two; the sketches not at all
            assert summary["sharded_parameters"] == names and summary["local_elements"] == 2_778 // 2
        else:
            assert summary["sharded_parameters"] == [] and summary["local_elements"] == 2_778
    assert_seed_built(final_parameters(out))
    assert_seed_built(load_file(str(export(checkpoint(out, 15), out / "export") / "model.safetensors")))


@pytest.mark.multiprocess
def test_two_process_resume_is_bitwise_identical_and_keeps_the_seed_built_sketches(two_process_run, tmp_path):
    layout, out = two_process_run
    train_and_dump(layout, tmp_path, "sketched", *RESUMABLE, f"resume={checkpoint(out, 15)}", world_size=2)

    assert_same_run(out, tmp_path, 15)
    for rank in (0, 1):
        assert_seed_built(rank_buffers(tmp_path, rank))

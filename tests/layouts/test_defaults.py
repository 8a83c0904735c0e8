"""Every shipped recipe at its defaults (only the run's length shortened): its batches split on every shipped
layout; it trains on every CPU layout that supports it and is refused in one line on the others; the chain the
docs walk (a base trained by hf_causal_lm, hf_finetune and sft_chat on it, dpo on sft_chat's) works at its
defaults; and `estimate` plans every recipe on every GPU layout or refuses it in the same line a run would.

The micro-batch size a recipe defaults to follows the layout (data/batching.py): the gan's 64 of 64 on 2
processes, the GPT's 16 of 32 on 8. The two walks train or plan about 200 runs (8 minutes on 2 cores): `make
test-matrix` runs them all. `make test` (and so CI, within its 25 minutes) checks every layout's batches and walks
one layout of each: every recipe trained on cpu_ddp (where the gan's defaults were refused) and planned on
8gpu_fsdp (where the GPT's were), with the chain the docs walk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import accel_trainer as at
from accel_trainer.contract.shipped import layouts
from accel_trainer.data.batching import plan_batches
from accel_trainer.estimate.command import estimate
from accel_trainer.estimate.step_memory import first_examples
from accel_trainer.parallel.accelerator import data_parallel_size_on_layout, settings_on_layout
from accel_trainer.parallel.layout_file import read_layout
from conftest import REPO, refusal_on_layout, train_and_dump

SHORT = ["max_steps=1", "eval_every_steps=0", "sanity_eval=false"]  # the run's length, not its shape
STANDALONE = ["vae", "gpt", "hf_causal_lm", "resnet", "mlp", "gan", "sketched"]
ON_A_BASE = ["hf_finetune", "sft_chat", "dpo"]  # base= is theirs to give: the chain's
CPU_LAYOUTS = ["cpu", "cpu_ddp", "cpu_fsdp", "cpu_tp", "cpu_pp", "cpu_hsdp", "cpu_fsdp_tp", "cpu_pp_fsdp"]
GPU_LAYOUTS = ["gpu", "4gpu_ddp", "4gpu_ddp_powersgd", "4gpu_fsdp", "8gpu_ddp", "8gpu_fsdp", "8gpu_fsdp_cp",
               "8gpu_fsdp_tp", "8gpu_pp_fsdp", "2node_4gpu", "2node_hsdp"]  # fmt: skip
NO_TP_PLAN, NO_CUT = "the recipe has no tp_plan", "pipeline parallelism needs to know where"
SEVERAL = "several optimizers cannot run with a pipeline, tensor-parallel, HSDP or context-parallel layout"
NO_TRANSFORMERS, NO_SEQUENCES = "a pipeline layout does not run transformers models", "has no sequence_dims"


def refusal_expected(recipe: str, layout: str) -> str | None:
    """A phrase of the one line in which a run of `recipe` at its defaults on `layout` is refused, or None."""
    tp, pp, cp = "_tp" in layout, "_pp" in layout, layout.endswith("_cp")
    if recipe == "gan" and (tp or pp or cp or "hsdp" in layout):
        return SEVERAL  # checked before anything else
    if tp and recipe not in ("gpt",):
        return NO_TP_PLAN
    if pp and recipe in ("vae", "mlp", "gan"):
        return NO_CUT
    if pp and recipe in ("hf_causal_lm", *ON_A_BASE):
        return NO_TRANSFORMERS
    if cp and recipe != "gpt":
        return NO_SEQUENCES
    return None


def layout_processes(layout: str) -> int:
    return read_layout(str(REPO / "accelerate_configs" / f"{layout}.yaml")).num_processes


@pytest.mark.parametrize("layout", sorted(layouts()))
def test_every_recipe_s_default_batches_split_over_the_data_parallel_ranks_of_every_layout(layout):
    spec = read_layout(str(REPO / "accelerate_configs" / f"{layout}.yaml"))
    for recipe in [*STANDALONE, *ON_A_BASE]:
        cfg, settings = settings_on_layout(at.get_recipe(recipe).Config, spec, None, {})
        ranks = data_parallel_size_on_layout(settings, spec)
        plan = plan_batches(cfg.global_batch_size, int(cfg.micro_batch_size), ranks or 1, fit=True)
        assert plan.micro_batch_size <= cfg.micro_batch_size and plan.num_processes == (ranks or 1)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, list[str]]:
    """Each recipe's base= at its defaults: hf_causal_lm's final for hf_finetune and sft_chat (its context 256
    holds sft_chat's 128-token windows), sft_chat's for dpo."""
    folder = tmp_path_factory.mktemp("chain")
    train_and_dump("cpu", folder / "base", "hf_causal_lm", *SHORT, world_size=1)
    train_and_dump("cpu", folder / "sft", "sft_chat", f"base={folder / 'base' / 'final'}", *SHORT, world_size=1)
    base, sft = f"base={folder / 'base' / 'final'}", f"base={folder / 'sft' / 'final'}"
    return {"hf_finetune": [base], "sft_chat": [base], "dpo": [sft], **{recipe: [] for recipe in STANDALONE}}


def walked_in(layouts: list[str], in_make_test: str) -> list:
    """`layouts` as test parameters: `in_make_test` in every run of the suite, the others under `make test-matrix`."""
    return [layout if layout == in_make_test else pytest.param(layout, marks=pytest.mark.matrix) for layout in layouts]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", walked_in(CPU_LAYOUTS, "cpu_ddp"))
def test_every_recipe_trains_at_its_defaults_on_each_cpu_layout_or_is_refused_in_one_line(layout, chain, tmp_path):
    outcomes = {
        recipe: refusal_on_layout(
            layout, tmp_path / recipe, recipe, *chain[recipe], *SHORT, world_size=layout_processes(layout)
        )  # fmt: skip
        for recipe in [*STANDALONE, *ON_A_BASE]
    }
    for recipe, refusal in outcomes.items():
        expected = refusal_expected(recipe, layout)
        if expected is None:
            assert refusal is None, f"{recipe} at its defaults was refused on {layout}: {refusal}"
            assert (tmp_path / recipe / "final").is_dir()
        else:
            assert refusal is not None and expected in refusal, f"{recipe} on {layout}: {refusal}"
            assert "\n" not in refusal


_EXAMPLES: dict[str, list] = {}


def examples_of(recipe: str, recipe_cls, cfg) -> list:
    """The recipe's first training rows at its default micro-batch, read once (every layout's is no larger)."""
    if recipe not in _EXAMPLES:
        _EXAMPLES[recipe] = first_examples(recipe_cls(cfg), cfg)
    return _EXAMPLES[recipe]


@pytest.mark.parametrize("layout", walked_in(GPU_LAYOUTS, "8gpu_fsdp"))
def test_estimate_plans_every_recipe_at_its_defaults_on_each_gpu_layout_or_refuses_it_as_a_run_would(layout, chain):
    """The first rank of each (every rank of a layout is planned alike: test_estimate.py)."""
    spec = read_layout(str(REPO / "accelerate_configs" / f"{layout}.yaml"))
    for recipe in [*STANDALONE, *ON_A_BASE]:
        overrides = dict(word.split("=", 1) for word in chain[recipe])
        recipe_cls = at.get_recipe(recipe)
        cfg, _ = settings_on_layout(recipe_cls.Config, spec, None, overrides)
        expected = refusal_expected(recipe, layout)
        try:
            (planned,) = estimate(recipe, spec, overrides, None, [0], examples_of(recipe, recipe_cls, cfg))
        except at.UserError as refusal:
            assert expected is not None and expected in str(refusal), f"{recipe} on {layout}: {refusal}"
            continue
        assert expected is None, f"{recipe} on {layout} was planned, not refused ({expected})"
        assert 0 < planned.params_bytes <= planned.peak_bytes, f"{recipe} on {layout}: {planned}"


def test_the_chain_the_docs_walk_keeps_its_commands(chain):
    """docs/preference.md's chain: the same recipes, each on the last one's final/."""
    walked = (REPO / "docs" / "preference.md").read_text()
    assert "accel-trainer train sft_chat base=runs/base/final" in walked
    assert "accel-trainer train dpo base=runs/sft/final" in walked
    assert Path(chain["dpo"][0].removeprefix("base=")).is_dir()

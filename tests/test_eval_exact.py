"""Evaluation reports the exact metrics of the saved model on every layout, whatever form the recipe returns.

Each test recomputes the metrics from `final/model.safetensors` over the whole eval set in the test process
and compares them with the run's last `eval/*` record. The eval sets do not divide over the processes, so the
last batch of a 2-process run is evened out with duplicates: they must never reach a metric.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import accel_trainer as at
from accel_trainer.checkpoint import files
from accel_trainer.contract.eval_outputs import metric_sums
from accel_trainer.errors import RecipeError
from conftest import WORKERS, final_parameters, read_metrics, train_and_dump

at.registry.discover_recipes([WORKERS / "recipes"])
digits = sys.modules[at.get_recipe("eval_forms").__module__].digits


def recomputed(run_dir: Path, num_eval: int) -> dict[str, float]:
    """The eval metrics of the run's final weights over every eval sample, computed here in one batch."""
    model = nn.Linear(64, 10)
    model.load_state_dict(final_parameters(run_dir))
    _, eval_set = digits(num_eval)
    batch = eval_set[:]
    with torch.no_grad():
        logits = model(batch["x"])
    losses = nn.functional.cross_entropy(logits, batch["y"], reduction="none").double()
    correct = (logits.argmax(dim=1) == batch["y"]).double()
    weights = batch["n"].double()
    accuracy = correct.mean().item()
    return {"eval/loss": losses.mean().item(), "eval/token_loss": ((losses * weights).sum() / weights.sum()).item(),
            "eval/mean_accuracy": accuracy, "eval/accuracy": accuracy, "eval/python_accuracy": accuracy}  # fmt: skip


def last_eval(records: list[dict]) -> dict[str, float]:
    return {k: v for k, v in [r for r in records if "eval/loss" in r][-1].items() if k.startswith("eval/")}


def assert_exact(reported: dict[str, float], expected: dict[str, float]) -> None:
    for name, value in expected.items():
        assert reported[name] == pytest.approx(value, rel=2e-6, abs=1e-7), name


@pytest.mark.parametrize("num_eval", [63, 52])
def test_one_process_eval_is_the_exact_mean_of_every_form(num_eval, tmp_path):
    result = at.train("eval_forms", output_dir=str(tmp_path), num_eval=num_eval, show_progress_bar=False, report=False)
    expected = recomputed(tmp_path, num_eval)
    assert_exact(last_eval(read_metrics(tmp_path)), expected)
    assert result.metrics["eval/token_loss"] != pytest.approx(expected["eval/loss"])  # weighting changes it


@pytest.mark.parametrize(
    ("layout", "num_eval"),
    [("cpu_ddp", 63), ("cpu_fsdp", 52), ("cpu_fsdp", 63), ("cpu_ddp", 52)],
)
@pytest.mark.multiprocess
def test_two_process_eval_is_the_exact_mean_despite_the_padding_duplicates(layout, num_eval, tmp_path):
    """63 samples leave one duplicate in process 1's last batch; 52 leave process 1 a last batch of duplicates
    only, which it must still run (FSDP's forward is collective) and count for nothing."""
    records = train_and_dump(layout, tmp_path, "eval_forms", f"num_eval={num_eval}", world_size=2)
    assert_exact(last_eval(records), recomputed(tmp_path, num_eval))


@pytest.mark.multiprocess
def test_the_default_eval_of_a_mean_loss_is_exact_on_two_processes(tmp_path):
    records = train_and_dump("cpu_ddp", tmp_path, "eval_forms", "forms=false", world_size=2)
    reported = last_eval(records)
    assert set(reported) == {"eval/loss", "eval/seconds"}
    assert reported["eval/loss"] == pytest.approx(recomputed(tmp_path, 63)["eval/loss"], rel=2e-6)


ROWS = 4
PER_SAMPLE = torch.tensor([1.0, 2.0, 3.0, 6.0])


def read(output) -> dict[str, float]:
    sums = metric_sums(output, ROWS, torch.device("cpu"))
    return {name: float(total / weight) for name, (total, weight) in sums.items()}


def test_num_items_weights_only_the_metric_it_is_paired_with():
    items = torch.tensor([1.0, 1.0, 1.0, 5.0])
    assert read({"loss": (PER_SAMPLE * items, items), "accuracy": PER_SAMPLE}) == {"loss": 36 / 8, "accuracy": 3.0}


def test_a_top_level_num_items_weights_a_single_metric():
    assert read({"loss": PER_SAMPLE, "num_items": torch.tensor([1.0, 1.0, 1.0, 5.0])}) == {"loss": 12 / 8}


def test_a_top_level_num_items_beside_two_metrics_is_refused_with_the_pair_form():
    with pytest.raises(RecipeError, match=r"'num_items' beside 2 metrics .*\{'loss': \(loss_sums, num_items\)\}"):
        read({"loss": PER_SAMPLE, "accuracy": PER_SAMPLE, "num_items": PER_SAMPLE})


def test_a_batch_mean_and_a_python_number_are_weighted_by_the_rows():
    sums = metric_sums({"a": PER_SAMPLE.mean(), "b": 3.0}, ROWS, torch.device("cpu"))
    assert [(float(t), float(w)) for t, w in sums.values()] == [(12.0, 4.0), (12.0, 4.0)]


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ({"loss": torch.ones(ROWS, 3)}, r"eval metric 'loss' has shape \(4, 3\) for a batch of 4 samples: return one"),
        ({"loss": torch.ones(ROWS + 1)}, r"has shape \(5,\) for a batch of 4 samples"),
        ({"scores": {"a": PER_SAMPLE}}, r"eval metric 'scores' is a dict; return \{name: per-sample tensor"),
        ({"loss": [1.0, 2.0, 3.0, 4.0]}, r"eval metric 'loss' is a list"),
        ({"loss": ("high", PER_SAMPLE)}, r"eval metric 'loss' \(sums\) is a str"),
        (PER_SAMPLE, r"eval_metrics returned Tensor; return \{name:"),
        ({1: PER_SAMPLE}, r"the metric name 1: name each metric with a string"),
    ],
)
def test_a_metric_of_another_form_is_a_one_line_error_naming_the_form(output, message):
    with pytest.raises(RecipeError, match=message) as error:
        read(output)
    assert "\n" not in str(error.value)


def test_a_nan_metric_is_reported_in_one_line_and_never_the_best_nor_an_improvement(tmp_path, capsys):
    at.train("eval_forms", output_dir=str(tmp_path), nan_metric=True, max_steps=12, keep_best_metric="eval/broken",
             early_stop_metric="eval/broken", early_stop_patience=2, show_progress_bar=False, report=False)  # fmt: skip
    out = capsys.readouterr().out
    assert (
        "accel-trainer: eval/broken=nan after step 3: not finite; keep-best and early stopping count it as no"
        " improvement" in out
    )
    assert "early stop after step 6: eval/broken has not been finite for 2 evaluation(s), the last nan" in out
    assert [r["step"] for r in read_metrics(tmp_path) if "eval/loss" in r] == [0, 3, 6]
    assert all(r["eval/broken"] != r["eval/broken"] for r in read_metrics(tmp_path) if "eval/loss" in r)
    state = json.loads((tmp_path / "checkpoints" / "step_00000006" / "train_state.json").read_text())
    assert state["best_checkpoint"] is None


def test_an_eval_metrics_error_after_training_keeps_the_training_in_a_checkpoint(tmp_path, monkeypatch):
    class WrongShapeAtTheEnd(at.get_recipe("mlp")):
        def eval_metrics(self, model, batch):
            return {"se": torch.ones(len(batch["y"]), 1)}  # one value per sample, but as a column

    monkeypatch.setitem(at.registry._recipes, "mlp_wrong_eval", WrongShapeAtTheEnd)
    with pytest.raises(
        RecipeError, match=r"has shape \(\d+, 1\).*\(the training up to step 3 is saved in .*step_00000003\)"
    ):
        at.train(
            "mlp_wrong_eval",
            max_steps=3,
            eval_every_steps=0,
            output_dir=str(tmp_path),
            show_progress_bar=False,
            report=False,
            sanity_eval=False,  # which would refuse it before training (the next test)
        )

    [saved] = files.complete_checkpoints(tmp_path)
    assert files.recorded_step(saved) == 3


def test_a_broken_eval_metric_or_eval_loss_is_one_line_naming_it_before_training_and_sanity_eval_false_skips_the_check(
    tmp_path, monkeypatch
):
    """sanity_eval (on by default): eval_metrics runs on the first eval batch before step 1, so a metric that fails
    is refused in one line naming it and where, before the run folder holds a run; a recipe without eval_metrics
    evaluates its compute_loss, which the line names instead."""

    class BrokenMetric(at.get_recipe("mlp")):
        def eval_metrics(self, model, batch):
            return {"accuracy": batch["label"]}  # a key the batch does not have

    monkeypatch.setitem(at.registry._recipes, "mlp_with_a_broken_metric", BrokenMetric)

    options = dict(max_steps=3, show_progress_bar=False, report=False)
    with pytest.raises(RecipeError, match=r"eval_metrics fails on the first eval batch, before training: KeyError:"
                                          r" 'label' \(.*test_eval_exact.py:\d+ in eval_metrics\)"):  # fmt: skip
        at.train("mlp_with_a_broken_metric", output_dir=str(tmp_path / "checked"), **options)
    assert not (tmp_path / "checked").exists()
    with pytest.raises(Exception, match="label"):  # unchecked, it fails in the evaluation after the training
        at.train("mlp_with_a_broken_metric", output_dir=str(tmp_path / "unchecked"), sanity_eval=False, **options)
    assert (tmp_path / "unchecked" / "metrics.jsonl").is_file()

    class BrokenLoss(at.get_recipe("mlp")):
        eval_metrics = at.Recipe.eval_metrics  # the default: the eval loss, from compute_loss

        def compute_loss(self, model, batch):
            return model(batch["label"]).mean()

    monkeypatch.setitem(at.registry._recipes, "mlp_with_a_broken_loss", BrokenLoss)
    with pytest.raises(RecipeError, match=r"^compute_loss \(the eval loss: the recipe has no eval_metrics of its own\)"
                                          r" fails on the first eval batch, before training: KeyError: 'label' "
                                          r"\(.*test_eval_exact.py:\d+ in compute_loss\)"):  # fmt: skip
        at.train("mlp_with_a_broken_loss", output_dir=str(tmp_path / "loss"), **options)

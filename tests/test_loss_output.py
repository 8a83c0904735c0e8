"""What compute_loss returns: a scalar mean or a mapping with num_items and extra terms, or a one-line error.

Extra terms are logged with the loss's own normalisation: over a log window that spans exactly one epoch,
a data-only term must equal its dataset mean (a plain mean, or a sum over items divided by the item count)
on 1 process and on 2 processes with accumulation; a term returned as (sum, count), over its own counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_trainer as at
from accel_trainer.contract.losses import read_loss_output
from accel_trainer.errors import RecipeError
from conftest import train_and_dump

SCALAR = torch.tensor(1.5)


def test_a_scalar_is_a_batch_mean_and_a_mapping_carries_items_and_terms():
    assert read_loss_output(SCALAR).num_items is None

    output = read_loss_output({"loss": SCALAR, "num_items": 7, "recon": torch.tensor(2.0, requires_grad=True)})

    assert int(output.num_items) == 7
    assert output.terms.keys() == {"recon"} and not output.terms["recon"].requires_grad

    counted = read_loss_output({"loss": SCALAR, "reward": (torch.tensor(3.0), 4)})

    assert float(counted.terms["reward"]) == 3.0 and int(counted.counts["reward"]) == 4


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ((SCALAR, torch.tensor(3.0)), "returned a tuple, which is ambiguous"),
        (torch.ones(4), r"the loss has shape \[4\], not a scalar"),
        ({"num_items": 3}, "a mapping without 'loss'"),
        ({"loss": SCALAR, "lr": SCALAR}, "term 'lr' collides with a key the loop logs"),
        ({"loss": SCALAR, "eval/acc": SCALAR}, "term 'eval/acc' collides"),
        ({"loss": SCALAR, "recon": torch.ones(2)}, r"term 'recon' has shape \[2\]"),
        ({"loss": 1.5}, "the loss is a float, not a tensor"),
        ([SCALAR], "returned list"),
    ],
    ids=["tuple", "vector", "no-loss", "lr", "eval-prefix", "vector-term", "float", "list"],
)
def test_other_returns_are_one_line_errors_naming_the_fix(returned, message):
    with pytest.raises(RecipeError, match=message):
        read_loss_output(returned)


def test_token_cross_entropy_sums_the_labelled_tokens_and_counts_them():
    logits, labels = torch.randn(2, 5, 11), torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])

    output = at.token_cross_entropy(logits, labels)
    shifted = at.token_cross_entropy(logits, labels, shift=True)

    assert int(output["num_items"]) == 8
    torch.testing.assert_close(output["loss"] / output["num_items"], F.cross_entropy(logits.view(10, 11),
                                                                                    labels.view(10)))  # fmt: skip
    expected = F.cross_entropy(logits[:, :-1].reshape(8, 11), labels[:, 1:].reshape(8), reduction="sum")
    assert int(shifted["num_items"]) == 6
    torch.testing.assert_close(shifted["loss"], expected)


def test_a_tuple_return_stops_a_real_run_before_any_step(tmp_path):
    @at.register_recipe("returns_a_tuple")
    class ReturnsATuple(at.get_recipe("vae")):
        def compute_loss(self, model, batch):
            return super().compute_loss(model, batch), torch.tensor(1.0)

    with pytest.raises(RecipeError, match="returned a tuple"):
        at.train("returns_a_tuple", output_dir=str(tmp_path), max_steps=2, show_progress_bar=False, report=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_item", [False, True], ids=["batch-mean", "num-items"])
@pytest.mark.parametrize(("layout", "world_size"), [("cpu", 1), ("cpu_ddp", 2)])
def test_extra_terms_are_logged_with_the_losss_normalisation(layout, world_size, per_item, tmp_path):
    from workers.recipes.terms import NUM_SAMPLES, term_data

    # 16 samples a step, 4 steps an epoch: each log window is one whole epoch, whatever the order.
    records = train_and_dump(layout, tmp_path, "terms", "max_steps=8", f"log_every_steps={NUM_SAMPLES // 16}",
                             "micro_batch_size=4", f"per_item={per_item}", "eval_every_steps=0",
                             world_size=world_size)  # fmt: skip

    data = term_data()
    name, expected = ("weight", data["w"].sum() / data["n"].sum()) if per_item else ("x_mean", data["x"].mean())
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [4, 8]
    for record in logged:
        assert record[name] == pytest.approx(float(expected), rel=1e-6)
        assert record["n_mean"] == pytest.approx(float(data["n"].mean()), rel=1e-6)  # a term with its own count

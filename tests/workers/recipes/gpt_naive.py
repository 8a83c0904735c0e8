"""The GPT recipe with the naive token-loss normalisation: the mean of each micro-batch.

The negative control of the equivalence tests: with variable-length sequences, averaging per micro-batch
weights the tokens of short micro-batches more, so the gradient is not that of one big batch
(the transformers gradient-accumulation bug, #34191).
"""

import accel_trainer as at

GPT = at.get_recipe("gpt")


@at.register_recipe("gpt_naive")
class NaiveGPT(GPT):
    """GPT with the loss averaged per micro-batch (wrong under accumulation; test only)."""

    def compute_loss(self, model, batch):
        output = super().compute_loss(model, batch)
        return output["loss"] / output["num_items"]

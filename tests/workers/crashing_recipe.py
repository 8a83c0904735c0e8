"""A VAE whose compute_loss reads a column the batch does not have: a bug in recipe code.

python tests/workers/crashing_recipe.py max_steps=2
"""

import accel_trainer as at

DigitsVAE = at.get_recipe("vae")


@at.register_recipe("crashing")
class Crashing(DigitsVAE):
    """VAE with a KeyError in compute_loss."""

    def compute_loss(self, model, batch):
        return super().compute_loss(model, batch)["loss"] + batch["no_such_column"]


if __name__ == "__main__":
    at.main("crashing")

"""accel-trainer: write a recipe once, train it on any layout accelerate can launch.

import accel_trainer as at

@at.register_recipe("demo")
class Demo(at.Recipe):
    Config = DemoConfig
    def build_model(self, cfg): ...
    def build_datasets(self, cfg): ...
    def compute_loss(self, model, batch): ...   # a mean loss, or at.token_cross_entropy(logits, labels)

if __name__ == "__main__":
    at.main("demo")
"""

from .config import TrainConfig
from .errors import ConfigError, LayoutError, RecipeError, UserError
from .layout import LayoutSettings
from .losses import token_cross_entropy
from .recipe import Recipe
from .registry import add_recipe, get_recipe, register_recipe, registered_recipes
from .run import TrainResult, main, train

__all__ = [
    "ConfigError",
    "LayoutError",
    "LayoutSettings",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "TrainResult",
    "UserError",
    "add_recipe",
    "get_recipe",
    "main",
    "register_recipe",
    "registered_recipes",
    "token_cross_entropy",
    "train",
]

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

The names below are imported on first use (PEP 562 `__getattr__`): the `accel-trainer` command imports this
package, and its answers that need no model (`--help`, `new`, `report`) then start without torch, accelerate
and datasets, which took 3 of the 3.3 s `accel-trainer --help` used to take.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel_trainer.commands.evaluate import evaluate_saved
    from accel_trainer.config.layout import LayoutSettings
    from accel_trainer.config.train_config import TrainConfig
    from accel_trainer.contract.frozen_in_16_bits import computation_dtype
    from accel_trainer.contract.lm_loss import (
        HeadLoss,
        lm_loss,
        lm_token_losses,
        lm_token_losses_and_entropies,
        measure_chunked_loss,
        with_chunked_loss,
    )
    from accel_trainer.contract.losses import token_cross_entropy
    from accel_trainer.contract.policy_gradient import group_advantages, policy_gradient_loss
    from accel_trainer.contract.preference import (
        completion_logps,
        completion_targets,
        preference_loss,
        preference_terms,
        sequence_logps,
    )
    from accel_trainer.contract.pretrained import (
        base_config_context,
        base_context,
        check_base,
        load_base_model,
        load_base_tokenizer,
    )
    from accel_trainer.contract.quantization import quantize_base
    from accel_trainer.contract.reference import PolicyAndReference, policy_and_reference
    from accel_trainer.data.sources import check_data, check_data_spec, read_data
    from accel_trainer.errors import ConfigError, LayoutError, RecipeError, UserError
    from accel_trainer.recipe import Recipe
    from accel_trainer.registry import add_recipe, get_recipe, register_recipe, registered_recipes
    from accel_trainer.stopping.signals import Preempted
    from accel_trainer.training import TrainResult, main, train

# Each public name (`__all__`, spelled out below for the linters) and the module that defines it.
_HOMES = {
    "ConfigError": "errors",
    "HeadLoss": "contract.lm_loss",
    "LayoutError": "errors",
    "LayoutSettings": "config.layout",
    "PolicyAndReference": "contract.reference",
    "Preempted": "stopping.signals",
    "Recipe": "recipe",
    "RecipeError": "errors",
    "TrainConfig": "config.train_config",
    "TrainResult": "training",
    "UserError": "errors",
    "add_recipe": "registry",
    "base_config_context": "contract.pretrained",
    "base_context": "contract.pretrained",
    "check_base": "contract.pretrained",
    "check_data": "data.sources",
    "check_data_spec": "data.sources",
    "completion_logps": "contract.preference",
    "completion_targets": "contract.preference",
    "computation_dtype": "contract.frozen_in_16_bits",
    "evaluate_saved": "commands.evaluate",
    "get_recipe": "registry",
    "group_advantages": "contract.policy_gradient",
    "lm_loss": "contract.lm_loss",
    "lm_token_losses": "contract.lm_loss",
    "lm_token_losses_and_entropies": "contract.lm_loss",
    "load_base_model": "contract.pretrained",
    "load_base_tokenizer": "contract.pretrained",
    "main": "training",
    "measure_chunked_loss": "contract.lm_loss",
    "policy_and_reference": "contract.reference",
    "policy_gradient_loss": "contract.policy_gradient",
    "preference_loss": "contract.preference",
    "preference_terms": "contract.preference",
    "quantize_base": "contract.quantization",
    "read_data": "data.sources",
    "register_recipe": "registry",
    "registered_recipes": "registry",
    "sequence_logps": "contract.preference",
    "token_cross_entropy": "contract.losses",
    "train": "training",
    "with_chunked_loss": "contract.lm_loss",
}

__all__ = [
    "ConfigError",
    "HeadLoss",
    "LayoutError",
    "LayoutSettings",
    "PolicyAndReference",
    "Preempted",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "TrainResult",
    "UserError",
    "add_recipe",
    "base_config_context",
    "base_context",
    "check_base",
    "check_data",
    "check_data_spec",
    "completion_logps",
    "completion_targets",
    "computation_dtype",
    "evaluate_saved",
    "get_recipe",
    "group_advantages",
    "lm_loss",
    "lm_token_losses",
    "lm_token_losses_and_entropies",
    "load_base_model",
    "load_base_tokenizer",
    "main",
    "measure_chunked_loss",
    "policy_and_reference",
    "policy_gradient_loss",
    "preference_loss",
    "preference_terms",
    "quantize_base",
    "read_data",
    "register_recipe",
    "registered_recipes",
    "sequence_logps",
    "token_cross_entropy",
    "train",
    "with_chunked_loss",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use; later uses find the name in this module's globals. A
    submodule (`at.registry`, `at.typed_fields`) is imported on first use too, as an eager import made it an
    attribute before."""
    home = _HOMES.get(name)
    if home is None:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

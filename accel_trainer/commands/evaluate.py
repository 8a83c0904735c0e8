"""`accel-trainer evaluate RUN|CHECKPOINT`: the recipe's evaluation of saved weights, printed as training logs it.

    accel-trainer evaluate outputs/gpt/run1                                  # the run's final weights
    accel-trainer evaluate outputs/gpt/run1/checkpoints/step_00000500        # one checkpoint's
    accel-trainer evaluate outputs/gpt/run1 eval_fraction=0.2               # config overrides on top
    accel-trainer evaluate outputs/gpt/run1 layout=cpu_fsdp                  # on a layout's processes
    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accel_trainer evaluate outputs/gpt/run1

A run folder means the weights the run left in final/ (the model it hands on); without them, or when a later resume
saved a newer checkpoint, its newest complete checkpoint. The recipe, step and config are the saved ones (a
checkpoint's train_state.json and config.yaml), key=value overrides on top. The weights are read whole (a sharded
checkpoint through export's reader, as `accel-trainer export` does) and loaded into the recipe's freshly built model
before the layout splits, shards or compiles it, so every layout evaluates with the code that evaluates during
training (`prepare_run`, `Evaluator.scores`). Nothing is written to the run folder. An EMA's weights are not evaluated
here: the model's are. With `--tasks`, lm-evaluation-harness's tasks score the weights instead (commands/benchmark.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from accel_trainer.checkpoint import checks, files
from accel_trainer.checkpoint.export import (
    checkpoint_folder,
    consolidated_weights,
    export,
    holds_only_trainable_weights,
)
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.final_weights import with_tied_names, write_model_folder
from accel_trainer.checkpoint.frozen import RECORD_KEY as FROZEN_RECORD
from accel_trainer.checkpoint.frozen import FrozenWeights, check_frozen
from accel_trainer.checkpoint.tokenizer import RECORD_KEY as TOKENIZER_RECORD
from accel_trainer.checkpoint.tokenizer import check_tokenizer, save_tokenizer, tokenizer_fingerprint
from accel_trainer.checkpoint.trained import RunIdentity
from accel_trainer.config.command_line import parse_command_line
from accel_trainer.config.train_config import resolve_settings
from accel_trainer.contract.pretrained import quiet_progress_bars
from accel_trainer.contract.reference import policy_of
from accel_trainer.engine.preparation import prepare_run
from accel_trainer.errors import RecipeError, UserError
from accel_trainer.observe.flops import model_on_meta
from accel_trainer.observe.metrics import console_line
from accel_trainer.parallel.accelerator import build_accelerator, launch_settings_file
from accel_trainer.parallel.layout_file import layout_environment
from accel_trainer.processes import end_launched_worker, launch_on_layout
from accel_trainer.recipe import Recipe
from accel_trainer.registry import get_recipe, recipe_name_of

# What an evaluation must not do with the saved config: train, resume, keep an EMA of its own, or log anywhere.
_EVALUATION_ONLY = {"resume": "none", "ema_decay": 0.0, "evaluate_ema": False, "trackers": "", "report": False}


@dataclass(frozen=True)
class SavedWeights:
    """Weights on disk and what they were trained as."""

    folder: Path  # the checkpoint, or the run's final/
    recipe_name: str
    step: int
    config_file: Path  # the saved config.yaml
    recipe_file: str | None = None  # the file that defined the recipe (runs saved since 2026-11-26)
    frozen: dict[str, Any] | None = None  # a checkpoint without its frozen weights: what it recorded of them
    tokenizer: str | None = None  # the fingerprint of the tokenizer the weights were trained with, if recorded

    def load(self) -> dict[str, torch.Tensor]:
        if (self.folder / checks.TRAIN_STATE).is_file():
            return consolidated_weights(self.folder)
        return load_file(str(self.folder / "model.safetensors"))


def saved_weights(source: Path) -> SavedWeights:
    """The weights `source` names: a checkpoint folder's, or a run folder's final/ (else its newest checkpoint).

    Raises:
        CheckpointError: `source` is neither, or holds no complete checkpoint to read the recipe and step from.
    """
    if (source / checks.TRAIN_STATE).is_file():
        files.verify(source)
        return _from_checkpoint(source, source)
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; name a run folder or a checkpoint folder")
    if not files.checkpoints_dir(source).is_dir():
        if (source / "config.yaml").is_file():
            raise CheckpointError(f"run folder {source} holds no weights: it stopped before its first checkpoint")
        raise CheckpointError(f"{source} is neither a run folder nor a checkpoint folder; name one of them")
    newest = files.newest_valid_checkpoint(source)
    if newest is None:
        raise CheckpointError(f"run folder {source} has no complete checkpoint, so its recipe and step are unknown")
    final = source / "final"
    merged = (final / "adapter").is_dir()  # final/ holds the adapter merged into its base: not the recipe's model
    return _from_checkpoint(newest, final if final_is_current(source, newest) and not merged else newest)


def final_is_current(run: Path, newest: Path) -> bool:
    """Whether the run's final/ holds its last weights: written after its newest checkpoint, `newest` (a resume
    that saved a newer checkpoint since has not written final/ yet)."""
    weights = run / "final" / "model.safetensors"
    return weights.is_file() and weights.stat().st_mtime >= (newest / checks.TRAIN_STATE).stat().st_mtime


def _from_checkpoint(checkpoint: Path, weights: Path) -> SavedWeights:
    state = json.loads((checkpoint / checks.TRAIN_STATE).read_text())
    frozen = state.get(FROZEN_RECORD) if weights == checkpoint else None
    return SavedWeights(
        weights, state["recipe"], state["step"], weights / "config.yaml", state.get("recipe_file"), frozen,
        state.get(TOKENIZER_RECORD),
    )  # fmt: skip


def saved_recipe(saved: SavedWeights) -> type[Recipe]:
    """The recipe the weights were trained with: registered, or defined in the file the run recorded (a recipe
    file trained from another folder, `accel-trainer train ./my_gpt.py`).

    Raises:
        RecipeError: neither, with the file the run was trained from when it is known.
    """
    try:
        return get_recipe(saved.recipe_name)
    except RecipeError:
        if not saved.recipe_file:
            raise
        if not Path(saved.recipe_file).is_file():
            raise RecipeError(
                f"recipe {saved.recipe_name!r} was defined in {saved.recipe_file}, which is not there any more:"
                " evaluate where its recipe file is (or registered)"
            ) from None
    return get_recipe(recipe_name_of(saved.recipe_file))


def evaluate_saved(source: str | Path, **overrides: Any) -> dict[str, float]:
    """The recipe's eval metrics of the weights `source` names, on this process's layout (or this launcher's),
    printed on the main process as training's evaluation line; `overrides` are config values, as `at.train`'s.

    Raises:
        UserError: the folder, the recipe, an override or the layout is wrong, the weights do not fit the
            recipe's model, or the recipe builds no eval set.
    """
    saved = saved_weights(Path(source))
    recipe_cls = saved_recipe(saved)
    with tempfile.TemporaryDirectory(prefix="accel-trainer-evaluate-") as scratch:  # a run folder nothing writes to
        values = {**overrides, **_EVALUATION_ONLY, "output_dir": scratch}
        cfg, layout = resolve_settings(recipe_cls.Config, saved.config_file, values, launch_settings_file())
        accelerator = build_accelerator(cfg, layout)
        recipe = recipe_cls(cfg)
        recipe.build_model = _loading(recipe, saved)  # type: ignore[method-assign]
        given = "micro_batch_size" in overrides  # the saved one follows this layout, as a recipe's default does
        identity = RunIdentity(saved.recipe_name, cfg, layout, micro_batch_size_given=given)
        run = prepare_run(recipe, identity, accelerator, Path(scratch))
        if not run.evaluator.has_eval:
            raise UserError(f"recipe {saved.recipe_name} builds no eval set (build_datasets): nothing to evaluate")
        started = time.perf_counter()
        scores = run.evaluator.scores()
        seconds = time.perf_counter() - started
    if accelerator.is_main_process:
        print(f"evaluated {saved.folder} ({saved.recipe_name}, step {saved.step}) on {accelerator.num_processes}"
              " process(es)")  # fmt: skip
        print(console_line({"step": saved.step, **scores, "eval/seconds": seconds}), flush=True)
    accelerator.end_training()
    return scores


def export_run(source: str | Path, output: str | Path | None = None) -> Path:
    """`accel-trainer export`: checkpoint/export.py's export, or for a transformers model or a checkpoint that holds
    only the trainable weights, the model its recipe builds again (reading its frozen base, checked against the
    checkpoint's fingerprint) with the saved weights, written as the run's final/ is (save_pretrained with the
    tokenizer; a peft model: merged, with `adapter/`)."""
    folder = checkpoint_folder(Path(source))
    quiet_progress_bars()
    saved = saved_weights(folder)
    recipe_cls = saved_recipe(saved)
    cfg, _ = resolve_settings(recipe_cls.Config, saved.config_file, {})
    recipe = recipe_cls(cfg)
    # a transformers model's export is a from_pretrained folder with its tokenizer (built on meta to see)
    if not holds_only_trainable_weights(folder) and not hasattr(model_on_meta(recipe, cfg), "save_pretrained"):
        return export(folder, output)
    target = Path(output) if output else folder.parent.parent / "export" / folder.name
    _export_with_base(recipe, saved, target)
    shutil.copyfile(folder / "config.yaml", target / "config.yaml")
    return target


def _export_with_base(recipe: Recipe, saved: SavedWeights, target: Path) -> None:
    recipe.tokenizer = recipe.build_tokenizer(recipe.cfg)
    model = _loading(recipe, saved)(recipe.cfg)
    target.mkdir(parents=True, exist_ok=True)
    write_model_folder(model.eval(), target)
    save_tokenizer(recipe.tokenizer, target)


def _loading(recipe: Recipe, saved: SavedWeights) -> Any:
    """The recipe's `build_model`, with the saved weights loaded into what it builds."""

    build_model = recipe.build_model

    def build_saved_model(cfg: Any) -> Any:
        check_tokenizer(saved.folder, {TOKENIZER_RECORD: saved.tokenizer}, tokenizer_fingerprint(recipe.tokenizer))
        model = build_model(cfg)
        try:
            weights = saved.load()
        except (OSError, SafetensorError, ValueError, KeyError) as error:
            raise CheckpointError(f"{saved.folder} cannot be read: {type(error).__name__}: {error}") from None
        frozen = FrozenWeights.of(model)
        on_meta = any(parameter.is_meta for parameter in model.parameters())  # filled by FSDP's broadcast
        if saved.frozen is not None and not on_meta:  # the checkpoint holds the trainable weights: these frozen ones
            check_frozen(saved.folder, {FROZEN_RECORD: saved.frozen}, frozen)
        try:
            target = model if any(name.startswith("policy.") for name in weights) else policy_of(model)
            weights = with_tied_names(target, weights)  # a transformers model's final/ holds a tied tensor once
            missing = target.load_state_dict(weights, strict=saved.frozen is None).missing_keys  # final/: the policy
            if frozen is not None and set(missing) - frozen.names:
                raise RuntimeError(f"missing keys: {sorted(set(missing) - frozen.names)[:3]}")
        except RuntimeError as error:  # missing, unexpected or misshapen tensors: the first line names them
            raise CheckpointError(
                f"the weights in {saved.folder} do not fit recipe {saved.recipe_name}'s model as this config builds"
                f" it: {str(error).splitlines()[-1].strip()}"
            ) from None
        return model

    return build_saved_model


def main(arguments: list[str]) -> None:
    """`accel-trainer evaluate SOURCE [key=value | --key value ...]`: exit status 0, or 2 with a one-line error."""
    status = 0
    try:
        if not arguments or arguments[0].startswith("-"):
            raise UserError(
                "usage: accel-trainer evaluate RUN_FOLDER|CHECKPOINT [layout=L] [key=value | --key value ...]"
            )
        line = parse_command_line(arguments[1:])
        if line.config_file or line.print_config:
            raise UserError("evaluate takes key=value overrides only: the config is the one saved with the weights")
        answered = launch_on_layout(line, ["-m", "accel_trainer", "evaluate", arguments[0], *line.own_words])
        if isinstance(answered, int):
            status = answered
        else:
            with layout_environment(answered) if answered else contextlib.nullcontext():
                evaluate_saved(arguments[0], **line.overrides)
    except UserError as error:
        sys.stderr.write(f"accel-trainer: error: {error}\n")
        status = 2
    end_launched_worker(status)
    raise SystemExit(status)

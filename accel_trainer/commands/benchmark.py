"""`accel-trainer evaluate RUN|CHECKPOINT --tasks NAME|FILE.yaml[,...]`: lm-evaluation-harness's tasks on saved
weights, the numbers `lm_eval --model hf --model_args pretrained=FOLDER --tasks ...` gives on the same folder.

    accel-trainer evaluate outputs/hf_finetune/run1 --tasks my_task.yaml                  # a task file of your own
    accel-trainer evaluate outputs/hf_finetune/run1 --tasks hellaswag,arc_easy --num_fewshot 5   # the harness's
    accel-trainer evaluate outputs/hf_finetune/run1/checkpoints/step_00000500 --tasks my_task.yaml --batch_size 8

A run folder means its final/ (a LoRA run's holds the adapter merged into its base), unless a resume saved a newer
checkpoint since; a checkpoint is first written as `accel-trainer export` writes it, into a scratch folder. The
folder is scored by the harness itself, `lm_eval.simple_evaluate(model="hf", model_args={"pretrained": FOLDER})`,
in this process (on a GPU where there is one, as the harness picks): nothing is scored here. Its results dict goes
to `<run>/lm_eval/<weights>-<tasks>.json` and a section of the run's report.md; its table is printed.
`--num_fewshot` and `--batch_size` are the harness's options of those names (defaults: the task's, and 1).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from accel_trainer.checkpoint import checks, files
from accel_trainer.commands.evaluate import export_run, final_is_current, saved_weights
from accel_trainer.engine.benchmarks import BenchmarkTasks
from accel_trainer.errors import UserError
from accel_trainer.observe.report import write_report
from accel_trainer.parallel.launch_fixes import launched_world_size

USAGE = "usage: accel-trainer evaluate RUN|CHECKPOINT --tasks NAME|FILE.yaml[,...] [--num_fewshot N] [--batch_size B]"
_OPTIONS = ("tasks", "num_fewshot", "batch_size")


def evaluate_tasks(
    source: str | Path, tasks: list[str], num_fewshot: int | None = None, batch_size: int | str = 1
) -> tuple[dict[str, Any], Path]:
    """lm_eval's results of the weights `source` names on `tasks`, and the file they were written to.

    Raises:
        UserError: lm_eval is missing, a task is unknown or its file missing, the folder holds no weights, or its
            recipe saves no transformers model.
    """
    if (launched_world_size() or 1) > 1:
        raise UserError("evaluate --tasks scores in one process (the harness's own): run it without a launcher")
    asked = BenchmarkTasks.of(tasks)  # before any model is read: a wrong task is said at once
    source = Path(source)
    with tempfile.TemporaryDirectory(prefix="accel-trainer-tasks-") as scratch:
        folder, run, weights = _model_folder(source, Path(scratch))
        import torch
        from lm_eval.utils import handle_non_serializable

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the harness's own choice without --device
        results = asked.score(
            "hf", model_args={"pretrained": str(folder)}, device=device, batch_size=batch_size, num_fewshot=num_fewshot
        )
    if folder.is_relative_to(scratch):  # exported from a checkpoint into a folder that is gone now
        results["config"]["model_args"] = {"pretrained": str(folder), "exported_from": str(source.resolve())}
    path = run / "lm_eval" / f"{weights}-{_slug(results)}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    if (run / "metrics.jsonl").is_file():
        write_report(run)
    return results, path


def _model_folder(source: Path, scratch: Path) -> tuple[Path, Path, str]:
    """The `from_pretrained` folder of the weights `source` names, their run folder, and what they are (final, or
    the checkpoint's name).

    Raises:
        CheckpointError: `source` is neither a run folder nor a checkpoint, or holds no weights.
        UserError: the recipe saves no transformers model.
    """
    saved = saved_weights(source)
    checkpoint = source if (source / checks.TRAIN_STATE).is_file() else files.newest_valid_checkpoint(source)
    assert checkpoint is not None  # saved_weights found it
    if checkpoint == source:
        folder, run, weights = export_run(source, scratch / "model"), source.parent.parent, source.name
    elif final_is_current(source, checkpoint):
        folder, run, weights = source / "final", source, "final"
    else:  # a resume saved a newer checkpoint since final/ was written
        folder, run, weights = export_run(checkpoint, scratch / "model"), source, checkpoint.name
    if not (folder / "config.json").is_file():
        raise UserError(
            f"recipe {saved.recipe_name} saves no transformers model (its weights have no config.json): the"
            " harness's hf model scores transformers causal LMs, such as hf_causal_lm's, hf_finetune's or sft_chat's"
        )
    return folder, run, weights


def _slug(results: dict[str, Any]) -> str:
    """The scored tasks' names as part of a file name."""
    names = "+".join(sorted(results["results"])) or "none"
    slug = re.sub(r"[^A-Za-z0-9_.+-]", "_", names)
    return slug if len(slug) <= 100 else f"{slug[:80]}+{len(results['results'])}_tasks"


def parse_arguments(arguments: list[str]) -> tuple[str, dict[str, Any]]:
    """SOURCE and the options of `evaluate SOURCE --tasks ...`.

    Raises:
        UserError: no source, an option without its value, or a word that is not one of the options.
    """
    if not arguments or arguments[0].startswith("-"):
        raise UserError(USAGE)
    options: dict[str, str] = {}
    words = iter(arguments[1:])
    for word in words:
        key, sep, value = word.removeprefix("--").partition("=")
        if not word.startswith("--") or key not in _OPTIONS:
            raise UserError(f"evaluate --tasks scores the saved weights as they are, and takes no {word!r}: {USAGE}")
        if not sep:
            value = next(words, "")
        if not value or value.startswith("--"):
            raise UserError(f"--{key} needs a value: {USAGE}")
        options[key] = value
    try:
        return arguments[0], {
            "tasks": options["tasks"].split(","),
            "num_fewshot": int(options["num_fewshot"]) if "num_fewshot" in options else None,
            "batch_size": _batch_size(options.get("batch_size", "1")),
        }
    except ValueError:
        raise UserError(f"--num_fewshot takes a whole number, not {options['num_fewshot']!r}") from None


def _batch_size(value: str) -> int | str:
    """An integer, or the harness's `auto` / `auto:N`."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    if re.fullmatch(r"auto(:\d+)?", value):
        return value
    raise UserError(f"--batch_size takes a positive whole number, auto or auto:N (the harness's), not {value!r}")


def main(arguments: list[str]) -> None:
    """`accel-trainer evaluate SOURCE --tasks ...`: exit status 0, or 2 with a one-line error."""
    try:
        source, options = parse_arguments(arguments)
        results, path = evaluate_tasks(source, **options)
    except UserError as error:
        sys.stderr.write(f"accel-trainer: error: {error}\n")
        raise SystemExit(2) from None
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"lm_eval's results: {path}", flush=True)
    raise SystemExit(0)

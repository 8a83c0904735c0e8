"""Benchmark tasks through EleutherAI's lm-evaluation-harness (`lm_eval`), scored by the harness itself.

Two users: `accel-trainer evaluate RUN --tasks ...` (commands/benchmark.py), which scores a saved
`from_pretrained` folder exactly as `lm_eval --model hf --model_args pretrained=FOLDER` does, and the run's
evaluations under `eval_tasks=` (`TrainingBenchmarks`), which score the model in hand on the main process through
the harness's `HFLM(pretrained=<the model>, tokenizer=...)`. Nothing here scores: `lm_eval.simple_evaluate` does,
with its own defaults (seeds, batch size 1, no few-shot unless the task or `num_fewshot` says so).

A task is a name the harness knows (or a glob of names, as its `--tasks` takes) or a task file (`.yaml`), read as
the harness reads it: its `dataset_kwargs` paths are relative to the working directory, not to the file.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from accel_trainer.errors import ConfigError, UserError
from accel_trainer.parallel.accelerator import layout_uses

INSTALL = "pip install 'accel-trainer[lm_eval]'"
_TASK_FILE_SUFFIXES = (".yaml", ".yml")


def harness() -> Any:
    """The `lm_eval` package, or a one-line error saying how to install it.

    Raises:
        UserError: lm-evaluation-harness is not installed.
    """
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager  # noqa: F401 - imported here, so that a broken install says so now
    except ImportError as error:
        raise UserError(f"benchmark tasks need lm-evaluation-harness ({error}): {INSTALL}") from None
    return lm_eval


@dataclass(frozen=True)
class BenchmarkTasks:
    """The tasks asked for, checked: each a task name (or glob) the harness knows, or a task file that exists,
    with the harness's `TaskManager` that resolves them (built once: indexing the harness's own tasks takes
    seconds, so it is built only when a name is asked for)."""

    specs: tuple[str, ...]  # names, and task files as absolute paths (the harness's `--tasks` makes them so)
    manager: Any

    @classmethod
    def of(cls, words: Sequence[str], setting: str = "--tasks") -> BenchmarkTasks:
        """The tasks `words` name, loaded by the harness; errors name `setting`.

        Raises:
            UserError: lm_eval is missing, no task is named, a task file does not exist, a name is unknown (with the
                nearest known names), or the harness cannot load a task.
        """
        harness()
        from lm_eval.tasks import TaskManager

        words = [word.strip() for word in words if word.strip()]
        if not words:
            raise ConfigError(f"{setting}: name one or more tasks (lm_eval names or task .yaml files), comma-separated")
        files = [word for word in words if word.endswith(_TASK_FILE_SUFFIXES)]
        for file in files:
            if not Path(file).is_file():
                raise ConfigError(f"{setting}: the task file {file} does not exist")
        names = [word for word in words if word not in files]
        manager = TaskManager(include_defaults=bool(names))
        specs: list[str] = []
        for word in words:
            if word in files:
                specs.append(str(Path(word).absolute()))
                continue
            matched = manager.match_tasks([word])
            if not matched:
                near = difflib.get_close_matches(word, manager.all_tasks, n=3)
                hint = f"; did you mean {', '.join(near)}?" if near else " (`lm_eval ls tasks` lists them)"
                raise ConfigError(f"{setting}: lm_eval knows no task {word!r}{hint}")
            specs += [name for name in matched if name not in specs]
        return cls(tuple(specs), _loading(manager, specs, setting, with_harness_tasks=bool(names)))

    def score(self, model: Any, **arguments: Any) -> dict[str, Any]:
        """lm_eval's results of `model` on the tasks: `simple_evaluate(model, tasks=..., **arguments)` (model: "hf"
        with `model_args`, as the harness's command line gives it, or an `HFLM`), its samples left out."""
        lm_eval = harness()
        with _quiet_expected_warnings():
            results = lm_eval.simple_evaluate(
                model, tasks=list(self.specs), task_manager=self.manager, log_samples=False, **arguments
            )
        results.pop("samples", None)
        return results  # type: ignore[no-any-return]


def _loading(manager: Any, specs: list[str], setting: str, with_harness_tasks: bool) -> Any:
    """`manager` once it has loaded the tasks (their files and data sets, read now rather than at the first
    evaluation); a manager of the harness's own tasks too where a task file names some of them (a group).

    Raises:
        ConfigError: the harness cannot load a task (a malformed file, a data set it cannot read).
    """
    from lm_eval.tasks import TaskManager

    try:
        try:
            manager.load(specs)
        except KeyError:
            if with_harness_tasks:
                raise
            manager = TaskManager()
            manager.load(specs)
    except Exception as error:  # noqa: BLE001 - the harness's, from YAML, jinja or datasets: said in one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ConfigError(f"{setting}: lm_eval cannot load the tasks: {type(error).__name__}: {first}") from None
    return manager


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """lm_eval's results as metrics: `lm_eval/<task>/<metric>` (a filter other than `none` appended:
    `lm_eval/gsm8k/exact_match/strict-match`), numbers only, their standard errors left out."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if not kept or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metrics[f"lm_eval/{task}/{metric}" + ("" if kept == "none" else f"/{kept}")] = float(value)
    return metrics


class TrainingBenchmarks:
    """`eval_tasks=`: the tasks scored at each evaluation of a run, on the main process, by the harness's HFLM on
    the model in hand (without its DDP wrapper nor torch.compile's) and the recipe's tokenizer, with lm_eval's
    default batch size (1), the modes of the model's modules put back after it; every process gets the main
    process's metrics."""

    def __init__(self, *, tasks: BenchmarkTasks, accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any):
        self.tasks, self.accelerator, self.model, self.tokenizer = tasks, accelerator, model, tokenizer

    @classmethod
    def of(
        cls, eval_tasks: Sequence[str], accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, sharded: str
    ) -> TrainingBenchmarks:
        """The run's benchmarks; `sharded`: why no process holds the whole model on this layout ("" where the main
        process does).

        Raises:
            UserError: the tasks are wrong (`BenchmarkTasks.of`), the model is not a transformers causal LM with a
                transformers tokenizer, or the layout shards it.
        """
        setting = f"eval_tasks={','.join(eval_tasks)}"
        refuse_sharded(eval_tasks, sharded)
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        if not _is_transformers_lm(unwrapped, tokenizer):
            raise ConfigError(
                f"{setting}: the harness scores a transformers causal LM with its tokenizer (HFLM), and this recipe"
                f" builds {type(unwrapped).__name__} with tokenizer {type(tokenizer).__name__}"
            )
        tasks = BenchmarkTasks.of(eval_tasks, setting)
        return cls(tasks=tasks, accelerator=accelerator, model=model, tokenizer=tokenizer)

    def scores(self) -> dict[str, float]:
        """`lm_eval/<task>/<metric>` of the model as it is now (every process waits for the main process's).

        Raises:
            UserError: the harness failed (on every process, which the evaluation then saves the training for).
        """
        found: dict[str, float] | str | None = None
        if self.accelerator.is_main_process:
            try:
                found = metrics_of(self._results())
            except Exception as error:  # noqa: BLE001 - the harness's: every process must hear of it, not only this one
                found = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        found = broadcast_object_list([found])[0]
        if isinstance(found, str):
            raise UserError(f"eval_tasks: lm_eval failed to score the model: {found}")
        return found  # type: ignore[return-value]

    def _results(self) -> dict[str, Any]:
        from lm_eval.models.huggingface import HFLM

        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # scored eagerly, as saved
        modes = {module: module.training for module in unwrapped.modules()}  # HFLM puts the model in eval mode
        try:
            with _quiet_expected_warnings():
                model = HFLM(pretrained=unwrapped, tokenizer=self.tokenizer)
            return self.tasks.score(model)
        finally:
            for module, training in modes.items():
                module.training = training


def _is_transformers_lm(model: Any, tokenizer: Any) -> bool:
    """Whether the harness's HFLM takes `model` and `tokenizer`: a transformers model (or peft's wrapper of one)
    that generates, and a transformers tokenizer."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return False
    return hasattr(model, "config") and hasattr(model, "generate") and isinstance(tokenizer, PreTrainedTokenizerBase)


def refuse_sharded(eval_tasks: Sequence[str], sharded: str) -> None:
    """A one-line refusal of `eval_tasks` where the main process does not hold the whole model (`sharded` says why)."""
    if eval_tasks and sharded:
        raise ConfigError(
            f"eval_tasks={','.join(eval_tasks)}: the harness scores the whole model on the main process, and {sharded}:"
            " leave eval_tasks out and score the saved weights after training (accel-trainer evaluate RUN --tasks ...)"
        )


def refuse_sharding_layout(eval_tasks: Sequence[str], settings: Any, layout: Any) -> None:
    """`refuse_sharded` before a layout's processes start, from its settings and launch variables (each process
    would refuse, and the launcher stop the others, after both built the model)."""
    kind = next((kind for kind in ("FSDP", "DEEPSPEED") if layout_uses(layout, kind)), "")
    sharded = f"{kind} shards it across the processes" if kind else ""
    sharded = PIPELINE_SHARDED if settings.pp_size > 1 else sharded
    refuse_sharded(eval_tasks, sharded or (TENSOR_SHARDED if settings.tp_size > 1 else ""))


def sharded_by(accelerator: Accelerator, model: torch.nn.Module, pipelined: bool) -> str:
    """Why the main process does not hold the whole model on this layout, or "" where it does (one process, DDP)."""
    if pipelined:
        return PIPELINE_SHARDED
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return f"{accelerator.distributed_type.value} shards it across the processes"
    from torch.distributed.tensor import DTensor

    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        return TENSOR_SHARDED
    return ""


PIPELINE_SHARDED = "a pipeline layout gives each process its stages only"
TENSOR_SHARDED = "this layout shards its parameters (tensor or context parallelism)"


class _ExpectedWarnings(logging.Filter):
    """The harness's warnings about what is done on purpose here: a model passed in (not a name), which it scores
    on this process only."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("already-initialized model" in message or "model kwarg is not of type" in message)


@contextlib.contextmanager
def _quiet_expected_warnings() -> Iterator[None]:
    """HFLM's two warnings about being handed a model object kept off the console, and git's "fatal: not a git
    repository" at each scoring: the harness records the git hash of the working directory (`git describe`, its
    stderr left on the console), which a run outside a repository printed at every evaluation."""
    import lm_eval.evaluator

    logger, quiet = logging.getLogger("lm_eval.models.huggingface"), _ExpectedWarnings()
    logger.addFilter(quiet)
    own = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _git_hash_quietly
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        lm_eval.evaluator.get_git_commit_hash = own


def _git_hash_quietly() -> str | None:
    """lm_eval's `get_git_commit_hash` with git's complaint outside a repository kept off the console."""
    try:
        described = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return described.stdout.strip()

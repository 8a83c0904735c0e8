"""`accel-trainer estimate NAME layout=L [key=value ...] [--json] [--device_memory_gb G]`: each process's memory.

    accel-trainer estimate gpt layout=8gpu_fsdp n_layer=24 d_model=2048 --device_memory_gb 80

Plays every rank of the layout in turn, each in a process forked from this one (estimate/fake_world.py), through
the run's own preparation and two training steps (estimate/step_memory.py), on a CPU, with no GPU: the layout's
refusals are the run's (sizes that do not divide, a batch that does not split), said in one line. With
`--device_memory_gb` it says whether each rank fits and, where one does not, which `micro_batch_size` or
`activation_checkpointing` would (estimate/advice.py).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import traceback
import warnings
from dataclasses import replace
from typing import Any

from accel_trainer.config.fields import micro_batch_size_given
from accel_trainer.config.train_config import resolve_settings
from accel_trainer.data.batching import plan_batches
from accel_trainer.errors import EstimateCrashed, RecipeError, UserError, describe_crash
from accel_trainer.estimate.advice import USABLE, advice
from accel_trainer.estimate.arguments import EstimateArguments
from accel_trainer.estimate.fake_world import fake_tensors, on_the_fake_device, played_rank
from accel_trainer.estimate.step_memory import RankMemory, first_examples, rank_memory
from accel_trainer.parallel.accelerator import build_accelerator, launch_settings_file, settings_on_layout
from accel_trainer.parallel.launch_fixes import forget_accelerate_state
from accel_trainer.parallel.layout_file import Layout, read_layout
from accel_trainer.parallel.mesh import data_ranks
from accel_trainer.registry import get_recipe, recipe_name_of


def estimate_command(arguments: EstimateArguments) -> None:
    """Run the command (its words read by estimate/arguments.py); prints the table, or the JSON with `--json`.

    Raises:
        UserError: an unknown recipe or layout, a bad override, or the layout's own refusal.
    """
    line, as_json, device_gb = arguments.line, arguments.as_json, arguments.device_gb
    assert line.layout is not None  # parse_estimate_arguments refuses a command without one
    recipe_name = recipe_name_of(arguments.recipe)
    layout = read_layout(line.layout, line.launcher_options)
    recipe_cls = get_recipe(recipe_name)
    if recipe_cls.rolls_out():  # its micro-batches are made by sampling with the weights: no first rows to size
        raise UserError(
            f"estimate {recipe_name}: the recipe makes each step's batches in a rollout (sampling with the model),"
            " which estimate cannot size yet; measure a short run's peak instead (its log's host_rss_gb)"
        )
    cfg, _ = settings_on_layout(recipe_cls.Config, layout, line.config_file, line.overrides)
    examples = first_examples(recipe_cls(cfg), cfg)  # read once: every rank's and the advice's (its first rows)
    estimated = estimate(recipe_name, layout, line.overrides, line.config_file, None, examples)
    said = None
    if device_gb is not None:
        again = functools.partial(worst_rank, recipe_name, layout, line, examples)
        said = advice(estimated, device_gb, estimated[0].micro_batch_size, lambda **changed: again(changed))
    if as_json:
        answer: dict[str, Any] = {"world_size": layout.num_processes, "per_rank": [r.as_dict() for r in estimated]}
        if said is not None and device_gb is not None:
            fits = all(memory.peak_bytes <= device_gb * 1e9 * USABLE for memory in estimated)
            answer.update(device_memory_gb=device_gb, fits=fits, advice=said)
        print(json.dumps(answer))
        return
    print(describe(recipe_name, layout, estimated))
    if said is not None:
        print(said)


def estimate(
    recipe_name: str,
    layout: Layout,
    overrides: dict[str, Any],
    config_file: str | None,
    ranks: Any,
    examples: list[Any],
) -> list[RankMemory]:
    """Each rank's memory (or the listed `ranks`', None for all) on `layout`, with the config `overrides` give,
    on the micro-batch of `examples` (the recipe's first training rows, read once by the caller).

    Each rank is played in a process of its own, forked from this one (torch is imported once), as each is in
    a real launch: DTensor and DeviceMesh keep process-wide caches that take two ranks' meshes for one (the
    second rank of an uneven tensor-parallel split got the first's shapes).

    Raises:
        UserError: the refusal of the first rank that refuses (the run's own, in one line).
    """
    recipe_cls = get_recipe(recipe_name)
    estimated = []
    for rank in range(layout.num_processes) if ranks is None else ranks:
        answer = _in_child(_estimate_rank, recipe_cls, layout, overrides, config_file, examples, rank)
        if isinstance(answer, BaseException):
            raise answer
        estimated.append(answer)
    return estimated


def _estimate_rank(
    recipe_cls: Any, layout: Layout, overrides: dict[str, Any], config_file: str | None, examples: list, rank: int
) -> RankMemory:
    warnings.filterwarnings("ignore", module=r"(torch|accelerate)\.")  # their advice is for the real run
    forget_accelerate_state()  # a state the parent made reading the examples (sft_chat's) holds a world of 1
    with played_rank(layout, rank):
        cfg, settings = resolve_settings(recipe_cls.Config, config_file, dict(overrides), launch_settings_file())
        accelerator = build_accelerator(cfg, settings)
        on_the_fake_device(accelerator)
        fit = not micro_batch_size_given(config_file, overrides)  # the recipe's default follows the layout
        plan = plan_batches(cfg.global_batch_size, int(cfg.micro_batch_size), data_ranks(accelerator).size, fit=fit)
        cfg, examples = replace(cfg, micro_batch_size=plan.micro_batch_size), examples[: plan.micro_batch_size]
        recipe = recipe_cls(cfg)
        recipe.tokenizer = recipe.build_tokenizer(cfg)
        with fake_tensors():
            return rank_memory(recipe, cfg, settings, accelerator, examples, rank)


def _in_child(function: Any, *args: Any) -> Any:
    """`function(*args)` in a forked process: its result, or the UserError it raised (any other error is a
    crash of the child, which prints its traceback and is said here in one line)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(send, function, args))
    child.start()
    send.close()
    try:
        answer = receive.recv()
    except EOFError:
        child.join()
        answer = RuntimeError(f"the process playing rank {args[-1]} died (exit status {child.exitcode})")
    child.join()
    return answer


def _answer(send: Any, function: Any, args: tuple) -> None:
    """Send the result, a UserError, or a crash described as the run describes one (the recipe's frames)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        send.send(function(*args))
    except UserError as error:
        send.send(type(error)(str(error)))
    except (DataDependentOutputException, DynamicOutputShapeException):
        if os.environ.get("ACCEL_TRAINER_FULL_TRACEBACK"):  # where the value was read
            traceback.print_exc()
        send.send(
            RecipeError(
                "the recipe reads a tensor's value in its model or compute_loss (.item(), .tolist(), `if tensor`,"
                " a shape from data), which estimate's fake tensors do not have: read values in eval_metrics, or"
                " only when not torch._subclasses.fake_tensor.is_fake(tensor)"
            )
        )
    except Exception as error:
        send.send(EstimateCrashed(describe_crash(error)))
    finally:
        send.close()


def worst_rank(recipe_name: str, layout: Layout, line: Any, examples: list[Any], changed: dict[str, Any]) -> RankMemory:
    """Rank 0 estimated again with `changed` settings (for the advice), on the first of `examples` a changed
    micro-batch size takes: it holds the largest shard of every parameter (FSDP pads the last ones) and a
    pipeline's first stage, which keeps the most activations."""
    size = int(changed.get("micro_batch_size", len(examples)))
    return estimate(recipe_name, layout, {**line.overrides, **changed}, line.config_file, [0], examples[:size])[0]


def describe(recipe_name: str, layout: Layout, estimated: list[RankMemory]) -> str:
    """The table: a line per rank, ranks of equal figures merged (`0-7`), in MiB (KiB where every peak is under
    1 MiB: a tiny model's read 0.0 throughout)."""
    unit, scale = ("KiB", 2**10) if max(memory.peak_bytes for memory in estimated) < 2**20 else ("MiB", 2**20)
    lines = [
        f"{recipe_name} on {layout.path.stem} ({layout.num_processes} process(es)): memory per process in {unit},"
        " estimated with fake tensors on this CPU (eager: torch.compile would hold no more)",
        f"{'ranks':>8} {'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>12} {'peak':>10}",
    ]
    for first, last, memory in _merged(estimated, scale):
        ranks = f"{first}" if first == last else f"{first}-{last}"
        shown = _shown(memory, scale)
        lines.append(
            f"{ranks:>8} " + " ".join(f"{value:>10}" for value in shown[:3]) + f" {shown[3]:>12} {shown[4]:>10}"
        )
    lines.append(
        "params, grads, optimizer: held after a step (a sharded layout's padded shards, though an optimizer's state"
        " is as long as the shard's real part; DDP's grads include its gradient buckets); activations: the rest of"
        " the peak (activations, temporaries, FSDP's gathered blocks)"
    )
    return "\n".join(lines)


def _merged(estimated: list[RankMemory], scale: int) -> list[tuple[int, int, RankMemory]]:
    """Consecutive ranks whose figures read the same at the table's precision (FSDP pads the last shards a few
    bytes apart) share a row."""
    rows: list[tuple[int, int, RankMemory]] = []
    for memory in estimated:
        if rows and _shown(rows[-1][2], scale) == _shown(memory, scale):
            rows[-1] = (rows[-1][0], memory.rank, rows[-1][2])
        else:
            rows.append((memory.rank, memory.rank, memory))
    return rows


def _shown(memory: RankMemory, scale: int) -> list[str]:
    return [f"{value / scale:.1f}" for key, value in memory.as_dict().items() if key != "rank"]

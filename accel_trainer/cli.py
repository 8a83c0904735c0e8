"""The `accel-trainer` command: `list` the recipes and layouts, `train` a recipe with key=value overrides, and more.

accel-trainer list                                       # recipes and layouts, from any folder
accel-trainer cp gpt my_gpt.py                           # a shipped recipe (or layout) to edit
accel-trainer train ./my_gpt.py max_steps=200            # a recipe file, or a name
accel-trainer new my_recipe                              # recipes/my_recipe.py from the template, ready to run
accel-trainer train vae max_steps=200
accel-trainer evaluate outputs/vae/<run>                # the eval metrics of its final weights
accel-trainer evaluate outputs/hf_finetune/<run> --tasks my_task.yaml,hellaswag   # lm-evaluation-harness's tasks
accel-trainer report outputs/vae/<run>                  # report.md and report.png
accel-trainer compare outputs/vae/run1 outputs/vae/run2 --output curves.png
accel-trainer doctor --config_file accelerate_configs/cpu_ddp.yaml   # environment, then launch checks of a layout
accel-trainer estimate gpt layout=8gpu_fsdp --device_memory_gb 80  # each process's memory, planned on this CPU
accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accel_trainer train vae

Each command imports what it needs when it runs, so that `--help` and the commands that need no model answer
without importing torch, accelerate or datasets (`accel-trainer --help` took 3.3 s, most of it torch).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from accel_trainer.console.closed_stdout import exit_quietly_when_stdout_closes
from accel_trainer.console.import_noise import drop_known_import_noise
from accel_trainer.console.warning_lines import show_our_warnings_as_one_line
from accel_trainer.errors import EstimateCrashed, UserError
from accel_trainer.estimate.arguments import parse_estimate_arguments
from accel_trainer.host.allocator import run_under_fast_allocator


def main(argv: list[str] | None = None) -> None:
    """The `accel-trainer` command; a closed stdout (`accel-trainer list | head -3`) ends it quietly. As the
    process's command, one that runs a model first replaces itself with the same command under tcmalloc or
    jemalloc where one is installed (host/allocator.py)."""
    if argv is None and sys.argv[1:2] in (["train"], ["evaluate"], ["sample"]):
        try:
            run_under_fast_allocator()
        except UserError as error:
            print(f"accel-trainer: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        signal.signal(signal.SIGINT, interrupted_while_starting)  # until a run's stop handlers replace it
    show_our_warnings_as_one_line()
    drop_known_import_noise()
    with exit_quietly_when_stdout_closes():
        _main(list(sys.argv[1:] if argv is None else argv))


def interrupted_while_starting(signum: int, frame: Any) -> None:
    """A Ctrl-C before a run's stop handlers are installed (the first seconds: importing torch): one line and exit
    130, where Python's KeyboardInterrupt printed a traceback from whatever module was importing. Nothing has
    trained yet; from the handlers on, a Ctrl-C saves a checkpoint (stopping/signals.py)."""
    print("accel-trainer: interrupted while starting, before anything trained", file=sys.stderr, flush=True)
    raise SystemExit(130)


def _parser() -> argparse.ArgumentParser:
    """The command's parser: its commands and their arguments."""
    parser = argparse.ArgumentParser(prog="accel-trainer", description="Train registered recipes.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print the recipes and the shipped layouts with a one-line description each")
    copier = commands.add_parser(
        "cp",
        help="copy a shipped recipe or layout to edit it: accel-trainer cp gpt my_gpt.py, accel-trainer cp cpu_fsdp .",
    )
    copier.add_argument("name", help="a shipped recipe's name or a shipped layout's name (accel-trainer list)")
    copier.add_argument("destination", help="a new file (my_gpt.py, my_fsdp.yaml) or an existing folder")
    _add_train_parser(commands)
    creator = commands.add_parser("new", help="write a new recipe file from the template (a small MLP on digits)")
    creator.add_argument("name", help="the recipe's name: lower-case letters, digits, underscores")
    creator.add_argument("--folder", default="recipes", help="where to write NAME.py (default: recipes)")
    exporter = commands.add_parser("export", help="write model.safetensors + config.yaml from a run or checkpoint")
    exporter.add_argument("source", help="a run folder (its newest complete checkpoint) or a checkpoint folder")
    exporter.add_argument("--output", help="where to write (default: <run>/export/<step>)")
    reporter = commands.add_parser("report", help="write <run>/report.md and report.png from a run's files")
    reporter.add_argument("run")
    comparer = commands.add_parser("compare", help="final metrics and config differences of runs, curves overlaid")
    comparer.add_argument("runs", nargs="+")
    comparer.add_argument("--output", help="draw the overlaid curves into this .png")
    comparer.add_argument("--x", default="step", help="align on step (default), samples or items seen")
    evaluator = commands.add_parser(
        "evaluate",
        help="the recipe's evaluation of a run's final weights or a checkpoint's, or lm-evaluation-harness's tasks",
        usage="accel-trainer evaluate RUN_FOLDER|CHECKPOINT [key=value | --key value ...]\n       accel-trainer"
        " evaluate RUN_FOLDER|CHECKPOINT --tasks NAME|FILE.yaml[,...] [--num_fewshot N] [--batch_size B]",
        description="Run the recipe's evaluation on saved weights and print the line training logs for them. A run"
        " folder means its final weights; key=value overrides go on top of the saved config; nothing is written. Under"
        " a launcher it evaluates on that layout: accelerate launch --config_file accelerate_configs/<layout>.yaml -m"
        " accel_trainer evaluate RUN. With --tasks, lm-evaluation-harness scores a transformers model's weights on"
        " its tasks, as `lm_eval --model hf --model_args pretrained=FOLDER` does, into <run>/lm_eval/ and report.md",
    )
    evaluator.add_argument("source", help="a run folder (its final weights) or a checkpoint folder")
    sampler = commands.add_parser("sample", help="print what a causal LM run's final model writes after a prompt")
    sampler.add_argument("run", help="a run folder (its final/) or a model folder")
    sampler.add_argument("--prompt", action="append", required=True, help="text to continue; repeat for several")
    sampler.add_argument("--max_new_tokens", type=int, default=64, help="tokens to write (default: 64)")
    sampler.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature (default: 0.8); 0: the most likely token"
    )
    sampler.add_argument("--seed", type=int, default=0, help="of the sampling (default: 0)")
    sampler.add_argument("--chat", action="store_true", help="each prompt is a user's message: the reply alone")
    _add_doctor_parser(commands)
    _add_estimate_parser(commands)
    return parser


def _main(arguments: list[str]) -> None:
    parser = _parser()
    if arguments[:1] == ["evaluate"] and not {"-h", "--help"} & set(arguments):
        if any(word == "--tasks" or word.startswith("--tasks=") for word in arguments):
            from accel_trainer.commands.benchmark import main as evaluate_main  # lm-evaluation-harness's tasks
        else:
            from accel_trainer.commands.evaluate import main as evaluate_main

        evaluate_main(arguments[1:])
        return
    if arguments[:1] == ["estimate"] and not {"-h", "--help"} & set(arguments):
        try:
            asked = parse_estimate_arguments(arguments[1:])  # before torch is imported: a mistake said at once
            from accel_trainer.estimate.command import estimate_command

            estimate_command(asked)
        except UserError as error:
            print(f"accel-trainer: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        except EstimateCrashed as crash:
            print(crash, file=sys.stderr)
            raise SystemExit(1) from None
        return
    if arguments[:1] == ["train"]:
        known = parser.parse_args(arguments[:2])
        from accel_trainer.training import main as train_main

        train_main(known.recipe, arguments[2:], program=["-m", "accel_trainer", "train", known.recipe])
        return
    words, launcher_options = _split_at_double_dash(arguments) if arguments[:1] == ["doctor"] else (arguments, [])
    known = parser.parse_args(words)
    known.launcher_options = launcher_options
    try:
        _dispatch(known)
    except UserError as error:
        print(f"accel-trainer: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _split_at_double_dash(arguments: list[str]) -> tuple[list[str], list[str]]:
    """The command's own words, and the launcher's after `--`."""
    if "--" not in arguments:
        return arguments, []
    return arguments[: arguments.index("--")], arguments[arguments.index("--") + 1 :]


def _dispatch(known: argparse.Namespace) -> None:
    """Run a command other than `train`, importing only what it needs."""
    if known.command == "list":
        print("recipes (accel-trainer train NAME key=value ...; accel-trainer cp NAME my_NAME.py to edit one):")
        _print_recipes(indent="  ")
        _print_layouts()
    elif known.command == "cp":
        from accel_trainer.contract.shipped import copy_shipped

        written = copy_shipped(known.name, known.destination)
        how = (
            f"train it with: accel-trainer train {written[0]} (or python {written[0]})"
            if written[0].suffix == ".py"
            else f"launch with: accelerate launch --config_file {written[0]} -m accel_trainer train RECIPE"
            f" layout={written[0]}"
        )
        print(f"copied {known.name} to {', '.join(map(str, written))}; {how}")
    elif known.command == "new":
        from accel_trainer.commands.new import write_new_recipe

        path = write_new_recipe(known.name, known.folder)
        print(f"wrote {path}; train it with: python {path} max_steps=300  (or accel-trainer train {path})")
    elif known.command == "report":
        from accel_trainer.observe.report import write_report

        print(f"report: {write_report(Path(known.run))}")
    elif known.command == "compare":
        from accel_trainer.observe.report import compare

        print(compare([Path(run) for run in known.runs], Path(known.output) if known.output else None, known.x))
    elif known.command == "sample":
        from accel_trainer.commands.sample import sample

        texts = sample(known.run, known.prompt, known.max_new_tokens, known.temperature, known.seed, known.chat)
        print("\n\n----------\n\n".join(texts))
    elif known.command == "doctor":
        from accel_trainer.doctor.command import doctor

        if known.layout is not None and not known.layout.startswith("layout="):
            raise UserError(f"doctor takes layout=NAME|FILE or --config_file FILE, not {known.layout!r}")
        layout = known.layout.removeprefix("layout=") if known.layout else None
        raise SystemExit(doctor(layout or known.config_file, known.timeout_s, known.launcher_options))
    else:
        from accel_trainer.commands.evaluate import export_run

        print(f"exported to {export_run(known.source, known.output)}")


def _print_recipes(indent: str = "") -> None:
    """Each registered recipe with its one-line description (imports the recipes, and so torch)."""
    from accel_trainer.registry import describe, registered_recipes

    recipes = registered_recipes()
    width = max((len(name) for name in recipes), default=0)
    for name, recipe_cls in recipes.items():
        print(f"{indent}{name:<{width}}  {describe(recipe_cls)}")


def _print_layouts() -> None:
    """Each shipped layout with the first line of its comment, and where the files are."""
    from accel_trainer.contract.shipped import describe_layout, layouts, layouts_folder

    shipped = layouts()
    width = max((len(name) for name in shipped), default=0)
    print(
        f"\nlayouts (accel-trainer train RECIPE layout=NAME, or accelerate launch --config_file"
        f" {layouts_folder()}/NAME.yaml -m accel_trainer train RECIPE layout=NAME):"
    )
    for name, path in shipped.items():
        print(f"  {name:<{width}}  {describe_layout(path)}")


class _TrainHelp(argparse.Action):
    """`accel-trainer train --help`: which recipes there are, and how to see one's config keys.

    The keys differ per recipe, so they are `accel-trainer train RECIPE --help`'s to print (training.py); argparse's
    own help of the `train` command only said that it takes a `recipe`.
    """

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.print_help()
        print("\nrecipes (`accel-trainer list`):")
        _print_recipes(indent="  ")
        parser.exit()


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="train a recipe: accel-trainer train RECIPE [--config FILE] key=value ... (--help: the recipes)",
        usage="accel-trainer train RECIPE [--config FILE.yaml] [--print-config] [key=value | --key value ...]",
        description="Train a registered recipe, in this process or in each process of a launcher:\n"
        "  accel-trainer train RECIPE key=value ...\n"
        "  accelerate launch --config_file accelerate_configs/<layout>.yaml -m accel_trainer train RECIPE key=value"
        " ...\n\nEach recipe has its own config keys: `accel-trainer train RECIPE --help` prints them, with their"
        " defaults and\nwhat each does.",
    )
    train.add_argument("recipe", metavar="RECIPE", help="a registered recipe's name (listed below)")
    train.add_argument("-h", "--help", nargs=0, action=_TrainHelp, help="show this help and the recipes, and exit")


def _add_estimate_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser(
        "estimate",
        help="each process's memory on a layout, planned on this CPU: accel-trainer estimate NAME layout=L",
        usage="accel-trainer estimate RECIPE layout=NAME|FILE [key=value ...] [--json] [--device_memory_gb G]",
        description="Play every process of the layout, each in a process forked from this one, with a fake process"
        " group and fake tensors,"
        " through the run's own preparation and two training steps of the recipe's first micro-batch, and print"
        " each process's parameters, gradients, optimizer state, activations and peak (MiB). The layout's"
        " refusals are the run's. --json: {world_size, per_rank: [{rank, params_bytes, grads_bytes,"
        " optimizer_bytes, activations_bytes, peak_bytes}]}. --device_memory_gb G: whether each process fits a"
        " device of G GB, and which micro_batch_size or activation_checkpointing would.",
    )


def _add_doctor_parser(commands: argparse._SubParsersAction) -> None:
    checker = commands.add_parser(
        "doctor",
        help="print the environment, launch a layout's processes and check them",
        description="Print the environment, launch the layout's processes for a few seconds and check the rendezvous,"
        " world size, an all-reduce, a broadcast and device placement, one line each. Exit status 0: all passed;"
        " 1: a check failed (its line says the fix); 2: the config file is missing or not an accelerate config."
        " Words after -- are accelerate launch's options: on each machine of a several-machine layout,"
        " -- --machine_rank R --main_process_ip HOST_OF_0.",
    )
    checker.add_argument("layout", nargs="?", help="layout=NAME|FILE: the same as --config_file NAME|FILE")
    checker.add_argument(
        "--config_file",
        help="the accelerate config to check (default: accelerate_configs/"
        "cpu_ddp.yaml, 2 processes: gloo on the CPU or 2 GPUs; gpu.yaml with one GPU)",
    )
    checker.add_argument("--timeout_s", type=float, default=60.0, help="stop the launch after this long (default 60)")


if __name__ == "__main__":
    main()

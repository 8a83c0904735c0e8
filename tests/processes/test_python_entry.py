"""Training from Python and notebooks: N processes from one call, recipes redefined in __main__.

`at.train(..., num_processes=2)` forks two gloo workers (accelerate's notebook_launcher) and returns the main
one's result, with weights equal to a 1-process run; a recipe class defined again in a module without a
source file (a notebook cell run twice) replaces the old one; field docs need no source code.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import accel_trainer as at
from accel_trainer.config.fields import describe_fields
from conftest import REPO, clean_env

SCRIPT = textwrap.dedent(
    """
    import signal, sys, torch
    from dataclasses import dataclass
    import datasets
    import accel_trainer as at
    from safetensors.torch import load_file

    @dataclass
    class Cfg(at.TrainConfig):
        max_steps: int = 6
        global_batch_size: int = 16
        micro_batch_size: int = 4
        warmup_steps: int = 0
        eval_every_steps: int = 0
        show_progress_bar: bool = False
        report: bool = False

    @at.register_recipe("defined_in_main")  # not importable by a launched script: only forking knows it
    class Line(at.Recipe):
        Config = Cfg
        def build_model(self, cfg):
            return torch.nn.Linear(2, 1)
        def build_datasets(self, cfg):
            x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
            return datasets.Dataset.from_dict({"x": x, "y": x.sum(1, keepdim=True)}).with_format("torch"), None
        def compute_loss(self, model, batch):
            return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    out = sys.argv[1]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    two = at.train("defined_in_main", num_processes=2, output_dir=out + "/two")
    print("handlers_kept", {sig: signal.getsignal(sig) for sig in handlers} == handlers)
    one = at.train("defined_in_main", output_dir=out + "/one")
    a, b = load_file(out + "/two/final/model.safetensors"), load_file(out + "/one/final/model.safetensors")
    print("world_size", two.metrics["world_size"], one.metrics["world_size"])
    print("run_dir", two.run_dir)
    print("max_diff", max((a[k] - b[k]).abs().max().item() for k in a))
    """
)


@pytest.mark.multiprocess
def test_num_processes_from_python_says_what_it_launches_and_trains_two_processes_like_one(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=clean_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=300)  # fmt: skip

    assert result.returncode == 0, result.stderr
    # accelerate's own line said "Launching training on 2 CUDAs." on a CPU-only machine
    assert "Launching training on" not in result.stdout
    said = "2 GPU processes (nccl)" if torch.cuda.device_count() else "2 CPU processes (gloo)"
    assert result.stdout.splitlines().count(f"accel-trainer: launching {said}") == 1
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines()
                 if line.startswith(("world", "run", "max", "handlers")))  # fmt: skip
    assert lines["handlers_kept"] == "True"  # torch's launcher left its own: a later Ctrl-C raised SignalException
    assert lines["world_size"] == "2 1"
    assert lines["run_dir"] == str(tmp_path / "two")
    assert float(lines["max_diff"]) < 1e-6


def test_canary_torchs_launcher_leaves_its_signal_handlers_installed_in_the_calling_process(tmp_path):
    """processes._launcher_defaults gives the caller's back (tests/conftest.py: a Ctrl-C ends the session)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    handlers = {sig: signal.getsignal(sig) for sig in stop_signals}
    try:  # the handlers are installed when it starts `true`
        start_processes("canary", "true", args={0: ()}, envs={0: {}},
                        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path))).close()  # fmt: skip
        left = {signal.Signals(sig).name: getattr(signal.getsignal(sig), "__name__", None) for sig in stop_signals}
    finally:
        for sig, handler in handlers.items():  # this pytest process's own
            signal.signal(sig, handler)

    assert set(left.values()) == {"_terminate_process_handler"}, left


CRASH = textwrap.dedent(
    """
    import accel_trainer as at

    Base = at.get_recipe("vae")

    @at.register_recipe("crashes_in_processes")
    class Crashes(Base):
        def compute_loss(self, model, batch):
            return batch["no_such_column"]

    @at.register_recipe("returns_a_tuple_in_processes")
    class Tuple(Base):
        def compute_loss(self, model, batch):
            return super().compute_loss(model, batch)["loss"], 1.0

    for name, expected in [("crashes_in_processes", KeyError), ("returns_a_tuple_in_processes", at.RecipeError)]:
        try:
            at.train(name, num_processes=2, max_steps=2, eval_every_steps=0, show_progress_bar=False, report=False)
        except expected as error:
            print("caught", type(error).__name__, error)
    """
)


@pytest.mark.multiprocess
def test_a_failure_on_n_processes_is_raised_as_itself_once(tmp_path):
    result = subprocess.run([sys.executable, "-c", CRASH], env=clean_env(), cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert "caught KeyError 'no_such_column'" in result.stdout
    assert "caught RecipeError compute_loss returned a tuple" in result.stdout
    assert result.stderr.count("error in recipe code, in compute_loss") == 1
    assert "ChildFailedError" not in result.stderr


WARNS = textwrap.dedent(
    """
    import sys, warnings
    import accel_trainer as at

    at.train("mlp", max_steps=2, warmup_steps=5, eval_every_steps=0, show_progress_bar=False, report=False,
             output_dir=sys.argv[1])
    warnings.warn("a warning of the user's own")
    """
)


def test_warnings_of_at_train_print_as_one_line_and_the_users_own_as_python_prints_them(tmp_path):
    result = subprocess.run([sys.executable, "-c", WARNS, str(tmp_path / "run")], env=clean_env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)  # fmt: skip

    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    ours = "accel-trainer: warmup_steps=5 is beyond max_steps=2: the learning rate never reaches its peak"
    assert ours in lines
    assert not [line for line in lines if "Warning: accel-trainer" in line or "warnings.warn(" in line]
    assert "<string>:7: UserWarning: a warning of the user's own" in lines


def test_a_recipe_redefined_in_a_notebook_replaces_the_old_one(monkeypatch):
    notebook = types.ModuleType("__main__")  # like a Jupyter kernel's: no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    cell = "import accel_trainer as at\n@at.register_recipe('cell_recipe')\nclass Cell(at.Recipe):\n    version = {}\n"

    exec(cell.format(1), notebook.__dict__)  # noqa: S102 - running a cell
    exec(cell.format(2), notebook.__dict__)  # noqa: S102 - running it again

    assert at.get_recipe("cell_recipe").version == 2
    monkeypatch.delitem(at.registry._recipes, "cell_recipe")


def test_field_docs_can_come_from_metadata_without_source():
    NotebookConfig = dataclasses.make_dataclass(  # noqa: N806 - a class, as a notebook would define it
        "NotebookConfig", [("width", int, dataclasses.field(default=8, metadata={"doc": "Hidden width."}))],
        bases=(at.TrainConfig,),
    )  # fmt: skip

    assert "  width=8  (int)  Hidden width." in describe_fields(NotebookConfig)


NOTEBOOK_CELLS = [
    "VERSION = 1",
    textwrap.dedent(
        """
        import torch, datasets, accel_trainer as at
        from dataclasses import dataclass, field

        @dataclass
        class Cfg(at.TrainConfig):
            max_steps: int = 6
            global_batch_size: int = 16
            micro_batch_size: int = 4
            warmup_steps: int = 0
            eval_every_steps: int = 0
            show_progress_bar: bool = False
            width: int = field(default=3, metadata={"doc": "Output width."})

        @at.register_recipe("in_a_notebook")
        class Line(at.Recipe):
            Config = Cfg
            version = VERSION
            def build_model(self, cfg):
                return torch.nn.Linear(2, 1)
            def build_datasets(self, cfg):
                x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
                return datasets.Dataset.from_dict({"x": x, "y": x.sum(1, keepdim=True)}).with_format("torch"), None
            def compute_loss(self, model, batch):
                return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        """
    ),
    "VERSION = 2",  # and the cell that defines the recipe runs again
]
NOTEBOOK_TRAIN = textwrap.dedent(
    """
    from safetensors.torch import load_file
    from accel_trainer.config.fields import describe_fields
    two = at.train("in_a_notebook", num_processes=2, output_dir="two")
    one = at.train("in_a_notebook", output_dir="one")
    a, b = load_file("two/final/model.safetensors"), load_file("one/final/model.safetensors")
    print("RESULT", two.metrics["world_size"], max((a[k] - b[k]).abs().max().item() for k in a),
          at.get_recipe("in_a_notebook").version, "Output width." in describe_fields(Cfg))
    """
)


@pytest.mark.multiprocess
def test_in_a_jupyter_kernel_cells_define_recipes_and_train_on_two_processes(tmp_path, monkeypatch):
    manager = pytest.importorskip("jupyter_client.manager")
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)  # the kernel inherits this environment
    kernel, client = manager.start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    printed: list[str] = []
    try:
        for cell in [*NOTEBOOK_CELLS, NOTEBOOK_CELLS[1], NOTEBOOK_TRAIN]:
            reply = client.execute_interactive(cell, timeout=240, output_hook=lambda message: printed.append(
                message["content"].get("text", "") if message["msg_type"] == "stream" else ""))  # fmt: skip
            assert reply["content"]["status"] == "ok", (reply["content"], "".join(printed))
    finally:
        client.stop_channels()
        kernel.shutdown_kernel(now=True)

    [result] = [line.split()[1:] for line in "".join(printed).splitlines() if line.startswith("RESULT")]
    world_size, max_difference, version, documented = result
    assert (world_size, version, documented) == ("2", "2", "True")
    assert float(max_difference) < 1e-6

"""`accel-trainer evaluate RUN|CHECKPOINT`: the recipe's evaluation of saved weights, the same figures training
logged for them, on any layout, writing nothing; a folder or config it cannot use is a one-line error."""

from __future__ import annotations

import sys

import pytest

import accel_trainer as at
from accel_trainer import cli
from accel_trainer.contract.shipped import copy_shipped
from conftest import (
    REPO,
    assert_one_line_error,
    exit_status,
    free_port,
    read_metrics,
    reset_accelerate_state,
    run_command,
)

MLP = dict(max_steps=20, eval_every_steps=10, save_every_steps=10, keep_last=0, log_every_steps=0)


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("mlp_run")
    at.train("mlp", output_dir=str(run), show_progress_bar=False, report=False, **MLP)
    reset_accelerate_state()
    return run


def evaluation_records(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if "eval/loss" in r}


def evaluate(capsys, *arguments: str) -> tuple[int, str, str]:
    status = exit_status(cli.main, ["evaluate", *map(str, arguments)])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def test_a_runs_final_weights_score_exactly_what_training_logged_last_and_nothing_is_written(mlp_run, capsys):
    files = sorted(mlp_run.rglob("*"))
    status, out, _ = evaluate(capsys, mlp_run)

    logged = evaluation_records(mlp_run)[20]
    assert status == 0
    assert f"evaluated {mlp_run / 'final'} (mlp, step 20) on 1 process(es)" in out
    (line,) = [line for line in out.splitlines() if line.startswith("step 20 | eval/loss")]
    assert f"eval/accuracy {logged['eval/accuracy']:.4g}" in line
    assert sorted(mlp_run.rglob("*")) == files


def test_a_checkpoints_weights_score_what_training_logged_at_its_step(mlp_run):
    scores = at.evaluate_saved(mlp_run / "checkpoints" / "step_00000010")
    reset_accelerate_state()

    logged = evaluation_records(mlp_run)[10]
    assert scores == {key: logged[key] for key in scores} and {"eval/loss", "eval/accuracy"} <= scores.keys()


@pytest.mark.multiprocess
def test_two_fsdp_processes_score_the_weights_as_one_process_does(mlp_run):
    result = run_command([sys.executable, "-m", "accel_trainer", "evaluate", mlp_run, "layout=cpu_fsdp", "--",
                          "--main_process_port", free_port()])  # fmt: skip

    (line,) = [line for line in result.stdout.splitlines() if line.startswith("step 20 |")]
    figures = dict(part.rsplit(" ", 1) for part in line.split(" | ")[1:])
    logged = evaluation_records(mlp_run)[20]
    assert float(figures["eval/loss"]) == pytest.approx(logged["eval/loss"], rel=1e-3)  # as printed: 4 digits
    assert float(figures["eval/accuracy"]) == pytest.approx(logged["eval/accuracy"], rel=1e-3)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{tmp}"], "is neither a run folder nor a checkpoint folder"),
        (["{tmp}/nowhere"], "nowhere does not exist; name a run folder or a checkpoint folder"),
        (["{run}", "hidden=8"], "do not fit recipe mlp's model as this config builds it: size mismatch for"),
        (["{run}", "lr=fast"], "lr='fast': expected float"),
        (["{run}", "--config", "x.yaml"], "evaluate takes key=value overrides only"),
        ([], "usage: accel-trainer evaluate RUN_FOLDER|CHECKPOINT [layout=L]"),
    ],
)
def test_what_evaluate_cannot_use_is_a_one_line_error(mlp_run, tmp_path, capsys, arguments, message):
    filled = [a.format(tmp=tmp_path, run=mlp_run) for a in arguments]
    status, _, err = evaluate(capsys, *filled)

    assert_one_line_error(status, err, message)


def test_a_run_that_stopped_before_its_first_checkpoint_is_said_to_hold_no_weights(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("max_steps: 5\n")  # what a run that crashed at its first step leaves
    status, _, err = evaluate(capsys, tmp_path)

    assert_one_line_error(status, err, "holds no weights: it stopped before its first checkpoint")


def test_a_recipe_without_an_eval_set_is_a_one_line_error(tmp_path, capsys):
    @at.register_recipe("mlp_without_eval")
    class WithoutEval(at.get_recipe("mlp")):  # type: ignore[misc]
        def build_datasets(self, cfg):
            return super().build_datasets(cfg)[0], None

    at.train("mlp_without_eval", output_dir=str(tmp_path), max_steps=2, show_progress_bar=False, report=False)
    reset_accelerate_state()
    status, _, err = evaluate(capsys, tmp_path)

    assert_one_line_error(status, err, "recipe mlp_without_eval builds no eval set (build_datasets)")


def test_a_run_of_a_recipe_file_is_evaluated_from_any_folder_while_its_file_is_there(tmp_path):
    copy_shipped("mlp", tmp_path / "mlp_of_a_file.py")
    at.train(str(tmp_path / "mlp_of_a_file.py"), output_dir=str(tmp_path / "run"), max_steps=4, show_progress_bar=False,
             report=False)  # fmt: skip
    reset_accelerate_state()
    evaluate_run = [sys.executable, "-m", "accel_trainer", "evaluate", str(tmp_path / "run")]

    evaluated = run_command(evaluate_run, cwd=REPO)  # mlp_of_a_file is registered nowhere here: the run names its file
    assert f"evaluated {tmp_path / 'run' / 'final'} (mlp_of_a_file, step 4)" in evaluated.stdout
    (tmp_path / "mlp_of_a_file.py").rename(tmp_path / "moved.py")
    gone = run_command(evaluate_run, cwd=REPO, check=False)
    assert_one_line_error(
        gone.returncode, gone.stderr, f"was defined in {tmp_path / 'mlp_of_a_file.py'}, which is not there"
    )

"""Benchmark tasks through lm-evaluation-harness (issue 51, part 2).

`accel-trainer evaluate RUN --tasks FILE.yaml` gives exactly the results of the harness's own command line,
`lm_eval --model hf --model_args pretrained=<run>/final --tasks FILE.yaml`, for a full fine-tune and a LoRA run, on
a local multiple-choice task (no download); `eval_tasks=` logs at each evaluation what `evaluate --tasks` gives for
that step's weights, and leaves the training as it was without it; what cannot work is one line.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

import accel_trainer as at
from accel_trainer import cli
from accel_trainer.engine.benchmarks import TrainingBenchmarks, sharded_by
from conftest import (
    LAUNCH_TIMEOUT_S,
    assert_one_line_error,
    clean_env,
    exit_status,
    final_parameters,
    read_metrics,
    reset_accelerate_state,
)

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("peft")

BASE = dict(n_layer=1, n_head=2, d_model=32, block_size=32, max_source_bytes=20_000, max_steps=2, eval_every_steps=0,
            global_batch_size=8, micro_batch_size=8, warmup_steps=0, dropout=0.1)  # fmt: skip
FINETUNE = dict(max_steps=4, block_size=32, max_source_bytes=20_000, global_batch_size=8, micro_batch_size=8,
                warmup_steps=1, lr=3e-3, log_every_steps=1, eval_every_steps=2, save_every_steps=2, keep_last=0,
                show_progress_bar=False, report=False)  # fmt: skip
METRICS = ("lm_eval/arith/acc", "lm_eval/arith/acc_norm", "lm_eval/arith/brier_score")


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """A multiple-choice task of 40 sums, its rows in a JSON-lines file beside it (named by absolute path)."""
    folder = tmp_path_factory.mktemp("tasks")
    draw, rows = random.Random(0), []
    for _ in range(40):
        a, b = draw.randrange(20), draw.randrange(20)
        offsets = [0, *draw.sample([-2, -1, 1, 2, 3], 3)]
        draw.shuffle(offsets)
        rows.append(
            {"question": f"{a} + {b} =", "choices": [str(a + b + o) for o in offsets], "label": offsets.index(0)}
        )
    (folder / "arith.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "arith.yaml").write_text(
        f"task: arith\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'arith.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: brier_score, aggregation: brier_score, higher_is_better: false}\n"  # continuous: no ties
    )
    return folder / "arith.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, task_file):
    """A tiny base of our own (hf_causal_lm, with dropout), and fine-tunes of it: in full and with LoRA scoring
    the task at each evaluation (steps 0, 2 and 4), and in full without the task."""
    base = tmp_path_factory.mktemp("base")
    at.train("hf_causal_lm", output_dir=str(base), show_progress_bar=False, report=False, **BASE)
    reset_accelerate_state()
    runs = {"base": base / "final"}
    for name, lora_r, tasks in (("full", 0, str(task_file)), ("lora", 4, str(task_file)), ("untasked", 0, "")):
        runs[name] = tmp_path_factory.mktemp(name)
        at.train("hf_finetune", base=str(runs["base"]), lora_r=lora_r, eval_tasks=tasks, output_dir=str(runs[name]),
                 **FINETUNE)  # fmt: skip
        reset_accelerate_state()
    return runs


def evaluate_tasks(capsys, *arguments) -> tuple[int, str, str]:
    status = exit_status(cli.main, ["evaluate", *map(str, arguments)])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def written(run, name: str) -> dict:
    return json.loads((run / "lm_eval" / name).read_text())


def test_evaluate_tasks_gives_the_results_of_the_harness_command_line_on_a_full_and_a_lora_finetune(
    runs, task_file, tmp_path, capsys
):
    harness = {
        kind: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "--model",
                "hf",
                "--model_args",
                f"pretrained={runs[kind] / 'final'}",
                "--tasks",
                str(task_file),
                "--device",
                "cpu",
                "--output_path",
                str(tmp_path / kind),
            ],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for kind in ("full", "lora")
    }
    try:
        ours = {}
        for kind in ("full", "lora"):  # while the harness's command lines run
            status, out, err = evaluate_tasks(capsys, runs[kind], "--tasks", task_file)
            assert status == 0, err
            assert f"lm_eval's results: {runs[kind] / 'lm_eval' / 'final-arith.json'}" in out
            assert "|arith|" in out  # the harness's own table
            ours[kind] = written(runs[kind], "final-arith.json")
        for process in harness.values():
            _, err = process.communicate(timeout=LAUNCH_TIMEOUT_S)
            assert process.returncode == 0, err
    finally:
        for process in harness.values():
            process.kill()
            process.wait()
    for kind in ("full", "lora"):
        (theirs,) = (tmp_path / kind).rglob("results_*.json")
        assert ours[kind]["results"] == json.loads(theirs.read_text())["results"], kind  # acc, acc_norm, stderr
        assert set(ours[kind]["results"]["arith"]) >= {"acc,none", "acc_norm,none"}
        report = (runs[kind] / "report.md").read_text()
        assert "## lm-evaluation-harness: lm_eval/final-arith.json" in report
        assert f"| arith | acc | {ours[kind]['results']['arith']['acc,none']:.4g} |" in report


def test_eval_tasks_log_at_each_evaluation_what_evaluate_tasks_gives_for_that_steps_weights(runs, task_file, capsys):
    for kind, weights, step, name, rel in (
        ("full", "checkpoints/step_00000002", 2, "step_00000002-arith.json", 0),  # exported from the checkpoint
        ("full", "", 4, "final-arith.json", 0),
        ("lora", "", 4, "final-arith.json", 1e-6),  # trained as an adapter on its base, scored merged into it
    ):
        status, _, err = evaluate_tasks(capsys, runs[kind] / weights, "--tasks", task_file)
        assert status == 0, err
        scored = written(runs[kind], name)["results"]["arith"]
        (logged,) = [record for record in read_metrics(runs[kind]) if record["step"] == step and METRICS[0] in record]
        assert (logged[METRICS[0]], logged[METRICS[1]]) == (scored["acc,none"], scored["acc_norm,none"]), kind
        assert logged[METRICS[2]] == pytest.approx(scored["brier_score,none"], rel=rel, abs=0), kind
        assert "eval/loss" in logged  # beside the recipe's own evaluation
    logged = {r["step"]: r[METRICS[2]] for r in read_metrics(runs["full"]) if METRICS[0] in r}
    assert list(logged) == [0, 2, 4] and len(set(logged.values())) == 3  # each evaluation scored other weights


def test_a_run_scoring_tasks_trains_as_the_same_run_without_them(runs):
    # the base's dropout draws from the random streams in training mode: the harness leaves both as they were
    tasked, untasked = read_metrics(runs["full"]), read_metrics(runs["untasked"])
    assert [r["loss"] for r in tasked if "loss" in r] == [r["loss"] for r in untasked if "loss" in r]
    assert [r["eval/loss"] for r in tasked if "eval/loss" in r] == [
        r["eval/loss"] for r in untasked if "eval/loss" in r
    ]
    expected, actual = final_parameters(runs["untasked"]), final_parameters(runs["full"])
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_a_recipe_without_an_eval_set_scores_its_tasks_alone_at_its_evaluations(runs, task_file, tmp_path):
    @at.register_recipe("hf_finetune_without_eval")
    class WithoutEval(at.get_recipe("hf_finetune")):  # type: ignore[misc]
        def build_datasets(self, cfg):
            return super().build_datasets(cfg)[0], None

    at.train("hf_finetune_without_eval", base=str(runs["base"]), lora_r=0, eval_tasks=str(task_file),
             output_dir=str(tmp_path), **FINETUNE)  # fmt: skip
    reset_accelerate_state()

    scored = [{k: v for k, v in r.items() if k in METRICS} for r in read_metrics(tmp_path) if METRICS[0] in r]
    expected = [{k: v for k, v in r.items() if k in METRICS} for r in read_metrics(runs["full"]) if METRICS[0] in r]
    assert scored == expected  # the same training as the full fine-tune's, which has an eval set
    assert not any("eval/loss" in record for record in read_metrics(tmp_path))


def test_what_evaluate_tasks_cannot_score_is_one_line(runs, task_file, tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere.yaml"
    for arguments, text in (
        ((runs["full"], "--tasks", missing), f"the task file {missing} does not exist"),
        ((runs["full"], "--tasks", "arithmetc"), "lm_eval knows no task 'arithmetc'; did you mean arithmetic"),
        ((runs["full"], "--tasks", task_file, "max_steps=3"), "takes no 'max_steps=3'"),
        ((runs["full"], "--tasks"), "--tasks needs a value"),
        ((runs["full"], "--tasks", task_file, "--batch_size", "0"), "--batch_size takes a positive whole number"),
        ((tmp_path, "--tasks", task_file), "is neither a run folder nor a checkpoint folder"),
    ):
        assert_one_line_error(*evaluate_tasks(capsys, *arguments)[::2], text)
    mlp = tmp_path / "mlp"
    at.train("mlp", output_dir=str(mlp), max_steps=1, eval_every_steps=0, show_progress_bar=False, report=False)
    reset_accelerate_state()
    assert_one_line_error(*evaluate_tasks(capsys, mlp, "--tasks", task_file)[::2], "recipe mlp saves no transformers")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as without the extra
    status, _, err = evaluate_tasks(capsys, runs["full"], "--tasks", task_file)
    assert_one_line_error(status, err, "pip install 'accel-trainer[lm_eval]'")


def test_eval_tasks_are_refused_before_training_where_the_harness_cannot_score_the_model(task_file, tmp_path):
    with pytest.raises(at.ConfigError, match="the harness scores a transformers causal LM with its tokenizer"):
        at.train("mlp", output_dir=str(tmp_path / "mlp"), max_steps=1, eval_tasks=str(task_file), report=False)
    assert not (tmp_path / "mlp" / "metrics.jsonl").exists()
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    sharded = sharded_by(fsdp, torch.nn.Linear(2, 2), pipelined=False)  # type: ignore[arg-type]
    assert sharded == "FSDP shards it across the processes"
    with pytest.raises(at.ConfigError, match="the harness scores the whole model on the main process, and FSDP shards"):
        TrainingBenchmarks.of([str(task_file)], fsdp, torch.nn.Linear(2, 2), None, sharded)  # type: ignore[arg-type]


def test_canary_the_harness_records_the_working_directorys_git_hash_and_ours_asks_git_quietly(
    tmp_path, capfd, monkeypatch
):
    """benchmarks._quiet_expected_warnings swaps lm_eval's `get_git_commit_hash` (git's "fatal: not a git
    repository" at each evaluation of a run outside a repository); the day the harness stops calling it, the swap
    can go."""
    import inspect

    import lm_eval.evaluator

    from accel_trainer.engine import benchmarks

    assert "get_git_commit_hash()" in inspect.getsource(lm_eval.evaluator.simple_evaluate)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert benchmarks._git_hash_quietly() is None
    assert "fatal" not in capfd.readouterr().err


def test_eval_tasks_on_a_sharding_layout_is_one_line_before_any_process_starts(tmp_path):
    command = [sys.executable, "-m", "accel_trainer", "train", "hf_causal_lm", "layout=cpu_fsdp",
               "eval_tasks=tasks.yaml", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300, cwd=tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, lines  # no worker started: no "rank 1: SIGTERM received"
    assert "FSDP shards it across the processes" in lines[0] and not (tmp_path / "run").exists()

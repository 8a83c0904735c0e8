"""A run ends with report.md and report.png; `accel-trainer report` redraws them, `compare` sets runs side by side."""

from __future__ import annotations

import json

import pytest

import accel_trainer as at
from accel_trainer.cli import main as cli
from accel_trainer.observe import report
from accel_trainer.observe.events import time_breakdown
from accel_trainer.observe.metrics import console_line
from accel_trainer.observe.number_format import readable
from accel_trainer.observe.report import _summary

QUICK = {"max_steps": 6, "log_every_steps": 2, "eval_every_steps": 3, "show_progress_bar": False}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    at.train("vae", output_dir=str(first), **QUICK)
    at.train("vae", output_dir=str(second), lr=0.004, **QUICK)
    return first, second


def test_a_finished_run_has_a_report_with_its_final_metrics_and_curves(two_runs):
    run = two_runs[0]
    report = (run / "report.md").read_text()
    assert "- steps: 6 of max_steps=6" in report and "- final evaluation: eval/loss" in report
    assert "items/s" in report and "![curves](report.png)" in report
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_gives_each_eval_metrics_range_and_the_best_in_keep_best_modes_direction():
    training = [{"step": 2, "loss": 1.0, "step_time_s": 0.5}, {"step": 4, "loss": 0.5, "step_time_s": 0.25}]
    evaluations = [{"step": 0, "eval/accuracy": 0.1}, {"step": 2, "eval/accuracy": 0.9},
                   {"step": 4, "eval/accuracy": 0.7}]  # fmt: skip

    summary = _summary(training, evaluations, {"max_steps": 4, "keep_best_metric": "eval/accuracy",
                                               "keep_best_mode": "max"})  # fmt: skip

    assert "- eval values over the run (lowest .. highest): eval/accuracy 0.1 .. 0.9" in summary
    assert "- best eval/accuracy (keep_best_mode=max): 0.9 at step 2" in summary
    assert "- optimizer steps take 1.5 s in all" in summary  # 2 steps x 0.5 s + 2 steps x 0.25 s
    assert "best" not in _summary(training, evaluations, {"max_steps": 4})


def test_throughput_reads_as_a_whole_number_with_thousands_separators_not_in_exponent_form():
    training = [{"step": 2, "items_per_s": 50440.3, "samples_per_s": 1234.56, "tflops": 0.00161}]

    summary = _summary(training, [], {"max_steps": 2})

    assert "- throughput (last window): 50,440 items/s, 1235 samples/s, 0.00161 TFLOP/s per device" in summary


def test_the_console_line_shows_throughput_as_a_whole_number_with_thousands_separators():
    record = {"step": 3, "loss": 2.27912, "lr": 0.00075, "items_per_s": 50440.3}

    assert console_line(record) == "step 3 | loss 2.279 | lr 0.00075 | items_per_s 50,440"


@pytest.mark.parametrize(
    ("value", "shown"),
    [(50440.3, "50,440"), (9999.5, "10,000"), (9999.4, "9999"), (-1.5e6, "-1,500,000"), (0.00075, "0.00075"),
     (3e-05, "3e-05"), (2.27912, "2.279"), (1e15, "1e+15"), (float("nan"), "nan"), (float("inf"), "inf")],
)  # fmt: skip
def test_a_number_reads_with_4_significant_digits_and_whole_with_separators_from_10000_up(value, shown):
    assert readable(value) == shown


def test_report_redraws_from_the_run_folder(two_runs, capsys):
    run = two_runs[0]
    (run / "report.png").unlink()
    cli(["report", str(run)])
    assert capsys.readouterr().out.strip() == f"report: {run / 'report.md'}"
    assert (run / "report.png").is_file()


def test_report_false_draws_nothing_at_the_end_and_the_command_draws_it_later(tmp_path, capsys):
    at.train("vae", output_dir=str(tmp_path), report=False, **QUICK)
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "report.png").exists()

    cli(["report", str(tmp_path)])
    assert "- steps: 6 of max_steps=6" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.png").is_file()


def test_compare_prints_both_runs_and_the_config_keys_that_differ(two_runs, tmp_path, capsys):
    first, second = two_runs
    cli(["compare", str(first), str(second), "--output", str(tmp_path / "curves.png"), "--x", "samples"])

    out = capsys.readouterr().out
    assert out.count("\n" + first.name) == 1 and out.count("\n" + second.name) == 1
    assert f"lr: {first.name}=0.002, {second.name}=0.004" in out
    assert (tmp_path / "curves.png").is_file()


def test_report_of_a_folder_that_is_not_a_run_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["report", str(tmp_path)])
    assert exited.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == f"accel-trainer: error: {tmp_path} is not a run folder (it has no metrics.jsonl)"
    )


def test_events_record_starts_evaluations_checkpoints_and_the_end_for_the_time_breakdown(tmp_path):
    at.train("vae", output_dir=str(tmp_path), save_every_steps=3, **QUICK)
    at.train("vae", output_dir=str(tmp_path), save_every_steps=3, **{**QUICK, "max_steps": 9})  # resumed

    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e.get("step")) for e in events]
    assert kinds == [("start", 0), ("eval", 0), ("eval", 3), ("checkpoint", 3), ("eval", 6), ("checkpoint", 6),
                     ("final", 6), ("end", 6), ("start", 6), ("eval", 9), ("checkpoint", 9), ("final", 9),
                     ("end", 9)]  # fmt: skip
    report_text = (tmp_path / "report.md").read_text()
    assert "over 2 attempt(s)" in report_text and "final weights " in report_text  # apart from training


def test_the_time_breakdown_shows_a_short_share_in_hundredths(tmp_path):
    events = [{"event": "start", "time": 10.0, "setup_s": 0.5}, {"event": "checkpoint", "time": 10.5, "seconds": 0.04},
              {"event": "end", "time": 11.0}]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    assert "checkpointing 0.04 s (3%)" in report._goodput(tmp_path)


def test_the_time_breakdown_counts_setup_and_keeps_a_restarts_setup_out_of_the_gap():
    events = [{"event": "start", "time": 10.0, "setup_s": 4.0}, {"event": "eval", "time": 11.0, "seconds": 1.0},
              {"event": "checkpoint", "time": 14.0, "seconds": 2.0}, {"event": "final", "time": 19.5, "seconds": 1.5},
              {"event": "end", "time": 20.0},
              {"event": "start", "time": 35.0, "setup_s": 5.0}, {"event": "end", "time": 40.0}]  # fmt: skip

    times = time_breakdown(events)

    assert times["wall"] == 4 + 10 + 15 + 5  # first setup, first attempt, gap (with the second setup), second
    assert (times["setup"], times["between_attempts"], times["evaluating"], times["checkpointing"]) == (9, 10, 1, 2)
    assert times["final_weights"] == 1.5 and times["training"] == 15 - 1 - 2 - 1.5
    parts = ("setup", "training", "evaluating", "checkpointing", "final_weights", "between_attempts")
    assert sum(times[k] for k in parts) == 34


def test_the_reward_panel_draws_the_reward_and_each_reward_functions_mean():
    from accel_trainer.observe.report import _PANELS, _panel_keys

    records = [{"step": 1, "loss": 0.1, "reward": 0.5, "rewards/short": 0.4, "rewards/correct": 0.1, "kl": 0.0}]
    assert ("reward", "reward") in _PANELS
    assert _panel_keys("reward", records) == ["reward", "rewards/correct", "rewards/short"]
    assert _panel_keys("loss", records) == ["loss"]

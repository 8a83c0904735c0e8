"""A run's report, drawn from its own files, and a comparison of runs: no server, no tracker needed.

`report.md` (summary, final and best metrics, time, throughput, MFU, memory) and `report.png` (loss, eval
metrics, LR, gradient norm, throughput, MFU, online RL's rewards, host memory) are written at the end of a run
and by `accel-trainer report RUN`, with a table of each benchmark result `accel-trainer evaluate RUN --tasks` wrote
(lm_eval/*.json). `accel-trainer compare RUN RUN ...` prints the final metrics side by side and
the config keys that differ, and overlays the curves, aligned on steps, samples or items seen. Plots need
matplotlib (the `report` extra); without it the report is text only and says so.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import yaml

from accel_trainer.errors import UserError
from accel_trainer.observe.events import read_events, time_breakdown
from accel_trainer.observe.metrics import format_metric
from accel_trainer.observe.number_format import readable

_X_KEYS = {"step": "step", "samples": "samples_seen", "items": "items_seen"}
_EVAL_PREFIXES = ("eval/", "eval_ema/", "lm_eval/")  # the weights' evaluations, their EMA's, benchmark tasks
_PANELS = [
    ("loss", "loss"),
    ("eval", "eval/"),
    ("lr", "lr"),
    ("grad_norm", "grad_norm"),
    ("items_per_s", "items_per_s"),
    ("mfu", "mfu"),
    ("reward", "reward"),  # online RL's (grpo): the weighted reward and each function's, rewards/<name>
    ("host memory (GB)", "host_rss_gb"),
]


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """A run folder's training records, evaluation records and config; a one-line error if it is not one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run folder (it has no metrics.jsonl)")
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    config_path = Path(run_dir) / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    training = [r for r in records if "loss" in r]
    evaluations = [r for r in records if any(key.startswith(_EVAL_PREFIXES) for key in r)]
    return training, evaluations, config or {}


def write_report(run_dir: Path) -> Path:
    """Write report.md (and report.png when matplotlib is there) into the run folder; return report.md."""
    run_dir = Path(run_dir)
    training, evaluations, config = read_run(run_dir)
    plotted = _plot({run_dir.name: (training, evaluations)}, run_dir / "report.png", "step")
    lines = [f"# {run_dir.name}", "", _summary(training, evaluations, config), _goodput(run_dir), ""]
    lines += ["![curves](report.png)" if plotted else "(no plot: `pip install 'accel-trainer[report]'` draws one)"]
    ops = run_dir / "profile" / "ops_rank0.txt"
    if ops.is_file():  # profile_steps was set: the top of rank 0's op table
        lines += [
            "",
            "## Top profiled ops (rank 0; all of them in profile/)",
            "",
            "```",
            *ops.read_text().splitlines()[:15],
            "```",
        ]
    lines += _benchmarks(run_dir)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _benchmarks(run_dir: Path) -> list[str]:
    """A table of each lm-evaluation-harness result `accel-trainer evaluate RUN --tasks` wrote (lm_eval/*.json):
    every task's metrics, with their standard errors."""
    lines = []
    for path in sorted((run_dir / "lm_eval").glob("*.json")):
        results = json.loads(path.read_text()).get("results", {})
        rows = [
            f"| {task} | {key.removesuffix(',none')} | {_short(value)} | {_short(_number(values, key, '_stderr'))} |"
            for task, values in results.items()
            for key, value in values.items()
            if "," in key and "_stderr," not in key and _number(values, key) is not None
        ]
        lines += ["", f"## lm-evaluation-harness: lm_eval/{path.name}", "", "| task | metric | value | stderr |"]
        lines += ["|---|---|---|---|", *rows]
    return lines


def compare(run_dirs: list[Path], output: Path | None = None, x: str = "step") -> str:
    """A table of the runs' final metrics and config differences; curves overlaid in `output` if given."""
    if x not in _X_KEYS:
        raise UserError(f"--x {x}: choose one of {', '.join(_X_KEYS)}")
    runs = {Path(d).name: read_run(Path(d)) for d in run_dirs}
    finals = {name: {**(t[-1] if t else {}), **(e[-1] if e else {})} for name, (t, e, _) in runs.items()}
    keys = [k for k in ("step", "loss", "items_per_s", "mfu") if any(k in f for f in finals.values())]
    keys += sorted({k for f in finals.values() for k in f if k.startswith(_EVAL_PREFIXES) and k != "eval/seconds"})
    width = max(len(name) for name in runs)
    table = [f"{'run':<{width}}  " + "  ".join(f"{k:>14}" for k in keys)]
    for name, final in finals.items():
        table.append(f"{name:<{width}}  " + "  ".join(f"{_short(final.get(k)):>14}" for k in keys))
    configs = {name: config for name, (_, _, config) in runs.items()}
    differing = sorted(
        {k for c in configs.values() for k in c if len({str(d.get(k)) for d in configs.values()}) > 1} - {"output_dir"}
    )
    table += ["", "config keys that differ:" if differing else "configs are the same (output_dir aside)"]
    table += [f"  {k}: " + ", ".join(f"{name}={configs[name].get(k)!r}" for name in runs) for k in differing]
    if output is not None:
        drawn = _plot({name: (t, e) for name, (t, e, _) in runs.items()}, Path(output), _X_KEYS[x])
        table.append(f"curves: {output}" if drawn else "(no plot: `pip install 'accel-trainer[report]'` draws one)")
    return "\n".join(table)


def _summary(training: list[dict], evaluations: list[dict], config: dict) -> str:
    last = training[-1] if training else {}
    rows = [f"- steps: {last.get('step', 0)} of max_steps={config.get('max_steps', '?')}"]
    rows.append(
        "- final training record: "
        + " | ".join(format_metric(k, v) for k, v in last.items() if k in ("loss", "reward", "lr", "grad_norm"))
    )
    skipped = {k: last[k] for k in ("nonfinite_steps", "skipped_steps") if last.get(k)}
    if skipped:  # steps that changed no weight: NaN/Inf losses or gradients, fp16 overflows
        rows.append("- steps skipped: " + ", ".join(f"{v} {k}" for k, v in skipped.items()))
    if evaluations:
        final = evaluations[-1]
        rows.append(
            "- final evaluation: "
            + " | ".join(format_metric(k, v) for k, v in final.items() if k.startswith(_EVAL_PREFIXES))
        )
        names = sorted({k for e in evaluations for k in e if k.startswith(_EVAL_PREFIXES) and k != "eval/seconds"})
        values = {k: [e[k] for e in evaluations if k in e] for k in names}
        spans = [f"{k} {readable(min(values[k]))} .. {readable(max(values[k]))}" for k in names]
        rows.append("- eval values over the run (lowest .. highest): " + ", ".join(spans))
        rows += _best(evaluations, config)
    trained_s = sum(
        r.get("step_time_s", 0) * (r["step"] - p)
        for p, r in zip([0] + [t["step"] for t in training], training, strict=False)
    )
    rows.append(f"- optimizer steps take {trained_s:.1f} s in all (step_time_s of the logged windows)")
    if last:
        rows.append(
            f"- throughput (last window): {readable(last.get('items_per_s', 0.0))} items/s,"
            f" {readable(last.get('samples_per_s', 0.0))} samples/s,"
            f" {last.get('tflops', 0):.3g} TFLOP/s per device" + (f", MFU {last['mfu']:.3g}" if "mfu" in last else "")
        )
        memory = [f"{k} {last[k]:.3g}" for k in ("mem_allocated_gb", "mem_reserved_gb", "host_rss_gb") if k in last]
        rows.append("- memory (peak of the last window): " + ", ".join(memory))
    return "\n".join(rows)


def _best(evaluations: list[dict], config: dict) -> list[str]:
    """The best evaluation by keep_best_metric in its direction (keep_best_mode), when the run names one."""
    name, mode = config.get("keep_best_metric"), config.get("keep_best_mode", "min")
    scored = [e for e in evaluations if name and name in e]
    if not scored:
        return []
    best = (min if mode == "min" else max)(scored, key=lambda e: e[name])
    return [f"- best {name} (keep_best_mode={mode}): {readable(best[name])} at step {best.get('step', '?')}"]


def _goodput(run_dir: Path) -> str:
    """The wall-time breakdown from events.jsonl: training, evaluating, checkpointing, lost between attempts."""
    times = time_breakdown(read_events(run_dir))
    if not times["attempts"]:
        return "- wall time: no events.jsonl"
    wall = times["wall"] or 1.0
    parts = [
        f"{name.replace('_', ' ')} {_seconds(times[name])} s ({100 * times[name] / wall:.0f}%)"
        for name in ("setup", "training", "evaluating", "checkpointing", "final_weights", "between_attempts")
    ]
    dropped = run_dir / "metrics.dropped.jsonl"
    retrained = sum('"loss"' in line for line in dropped.read_text().splitlines()) if dropped.is_file() else 0
    return (
        f"- wall time {times['wall']:.1f} s over {int(times['attempts'])} attempt(s): "
        + ", ".join(parts)
        + (f"; {retrained} logged step(s) were trained again after a resume" if retrained else "")
    )


def _number(values: dict[str, Any], key: str, suffix: str = "") -> float | None:
    """lm_eval's `metric,filter` value (with `suffix`, `metric<suffix>,filter`), where it is a number."""
    value = values.get(key.replace(",", f"{suffix},", 1))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _seconds(value: float) -> str:
    """Tenths from a second up, two significant digits below (a 0.04 s share of a short run read 0.0 s, 4%)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _plot(runs: dict[str, tuple[list[dict], list[dict]]], path: Path, x_key: str) -> bool:
    """Draw the panels for every run into `path`; False when matplotlib is not installed.

    A `Figure` of its own, without pyplot: no global state, no backend to choose, one import less. Fixed margins
    instead of `tight_layout`, which measured every label again and took half of the drawing time (0.35 of
    0.7 s) at the end of every run. Evaluations are marked points: a run evaluated once has a curve of one.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=(20, 8))
    figure.subplots_adjust(left=0.04, right=0.98, bottom=0.07, top=0.95, wspace=0.2, hspace=0.3)
    axes = figure.subplots(2, 4)
    for axis, (title, key) in zip(axes.flat, _PANELS, strict=True):
        for name, (training, evaluations) in runs.items():
            records = evaluations if key == "eval/" else training
            keys = _panel_keys(key, records)
            for k in keys:
                points = [(r[x_key], r[k]) for r in records if r.get(k) is not None and r.get(x_key) is not None]
                if points:  # an EMA's evaluation dashed, so that it does not hide the weights' own
                    axis.plot(
                        *zip(*points, strict=True),
                        label=f"{name} {k}" if len(runs) > 1 else k,
                        linestyle="--" if k.startswith("eval_ema/") else "-",
                        marker="o" if key == "eval/" else None,
                        markersize=3,
                    )
        axis.set_title(title)
        axis.set_xlabel(x_key)
        if axis.lines:
            axis.legend(fontsize="small")
        else:
            axis.text(
                0.5,
                0.5,
                "not logged" + (" (set peak_tflops)" if key == "mfu" else ""),
                ha="center",
                transform=axis.transAxes,
            )
    figure.savefig(path, dpi=80)
    return True


def _panel_keys(key: str, records: list[dict[str, Any]]) -> list[str]:
    """The logged keys a panel draws: every evaluation metric, the reward with each function's, or one key."""
    logged = sorted({k for r in records for k in r})
    if key == "eval/":
        return [k for k in logged if k.startswith(_EVAL_PREFIXES) and k != "eval/seconds"]
    if key == "reward":
        return ["reward", *(k for k in logged if k.startswith("rewards/"))]
    return [key]


def _short(value: Any) -> str:
    return "-" if value is None else readable(value) if isinstance(value, float) else str(value)


def write_report_or_warn(run_dir: Path) -> None:
    """The end-of-run report; a failure to draw it is a warning, never a failed run."""
    try:
        write_report(run_dir)
    except Exception as error:  # noqa: BLE001 - the run itself is done and saved
        warnings.warn(
            f"accel-trainer: the report of {run_dir} could not be written ({type(error).__name__}:"
            f" {error}); `accel-trainer report {run_dir}` tries again",
            stacklevel=2,
        )

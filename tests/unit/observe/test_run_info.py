"""A run says what it is at start (header, run_info.json, model_summary.txt) and shows progress in a log file."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType, ParallelismConfig

import accel_trainer as at
from accel_trainer.observe import metrics
from accel_trainer.observe.header import _strategy
from accel_trainer.parallel import launch_fixes
from conftest import read_metrics


def test_a_run_prints_a_header_and_records_each_start(tmp_path, capsys):
    at.train("vae", max_steps=4, save_every_steps=2, keep_last=0, output_dir=str(tmp_path), show_progress_bar=False)
    out = capsys.readouterr().out
    assert "accel-trainer: recipe vae, 171,088 parameters" in out
    assert "batch: 64 per step = 32 per micro-batch x 1 process(es) x 2 accumulation step(s)\n" in out
    peak = max(record["host_rss_gb"] for record in read_metrics(tmp_path) if "host_rss_gb" in record)
    assert f"accel-trainer: peak memory: host {peak:.2f} GiB resident (the largest process)\n" in out
    end = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["host_rss_gb"] == peak and "mem_allocated_gb" not in end  # no CUDA here

    at.train("vae", max_steps=6, save_every_steps=2, keep_last=0, output_dir=str(tmp_path), show_progress_bar=False)

    starts = json.loads((tmp_path / "run_info.json").read_text())["starts"]
    assert [start["start_step"] for start in starts] == [0, 4]
    assert starts[0]["versions"]["torch"] == __import__("torch").__version__
    assert starts[0]["layout"]["num_processes"] == 1 and "collective_timeout_s" in starts[0]["layout"]
    assert "parameters: 171,088" in (tmp_path / "model_summary.txt").read_text()


def test_off_a_terminal_the_progress_bar_is_a_status_line_at_most_every_30_s(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(metrics, "STATUS_EVERY_S", 0.0)  # every step, to see it in a short run
    at.train("vae", max_steps=5, log_every_steps=0, output_dir=str(tmp_path), show_progress_bar=True)

    out = capsys.readouterr()
    assert "step 3/5 (60%) | eta" in out.out
    assert "it/s" not in out.err and "step/s" not in out.err  # no tqdm bar in a log file


@pytest.mark.parametrize(
    ("distributed_type", "processes", "sizes", "words"),
    [(DistributedType.NO, 1, None, "single process"), (DistributedType.MULTI_CPU, 2, None, "DDP"),
     (DistributedType.MULTI_GPU, 2, {"tp_size": 2}, "tensor parallel"), (DistributedType.FSDP, 4, None, "FSDP2"),
     (DistributedType.MULTI_CPU, 2, {"pp_size": 2}, "pipeline parallel"),
     (DistributedType.FSDP, 4, {"pp_size": 2}, "pipeline parallel x FSDP2")],
)  # fmt: skip
def test_the_header_names_the_strategy_in_the_docs_words(distributed_type, processes, sizes, words):
    config = None
    if sizes is not None:
        config = launch_fixes.PipelineParallelism(**sizes) if "pp_size" in sizes else ParallelismConfig(**sizes)
    accelerator = SimpleNamespace(distributed_type=distributed_type, num_processes=processes, process_index=0,
                                  parallelism_config=config)  # fmt: skip
    assert _strategy(accelerator) == words


def test_the_header_says_when_the_recipe_s_default_micro_batch_was_lowered_to_split_the_global_batch(tmp_path, capsys):
    at.train("vae", max_steps=1, global_batch_size=48, output_dir=str(tmp_path), show_progress_bar=False, report=False)
    assert (
        "batch: 48 per step = 24 per micro-batch x 1 process(es) x 2 accumulation step(s) (the recipe's micro-batch"
        " of 32 does not split 48 over 1 rank(s): 24, the largest below it that does; micro_batch_size= sets it)"
    ) in capsys.readouterr().out
    (start,) = json.loads((tmp_path / "run_info.json").read_text())["starts"]
    assert start["batch"] == {"global_batch_size": 48, "micro_batch_size": 24, "data_parallel_ranks": 1,
                              "accumulation_steps": 2, "fitted_from": 32}  # fmt: skip
    assert "micro_batch_size: 32" in (tmp_path / "config.yaml").read_text()  # as asked: it follows the next layout
    with pytest.raises(at.ConfigError, match="global_batch_size=48 is not a multiple of micro_batch_size=32"):
        at.train("vae", max_steps=1, global_batch_size=48, micro_batch_size=32, output_dir=str(tmp_path / "set"))

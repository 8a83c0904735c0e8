"""profile_steps=a-b profiles those optimizer steps on every process with accelerate's profiler."""

from __future__ import annotations

import json

import pytest

import accel_trainer as at
from conftest import train_and_dump


def test_chosen_steps_leave_a_chrome_trace_and_an_op_table(tmp_path):
    at.train("vae", max_steps=4, profile_steps="2-3", output_dir=str(tmp_path), show_progress_bar=False)

    trace = json.loads((tmp_path / "profile" / "profile_0.json").read_text())
    assert any(event.get("name") == "aten::addmm" for event in trace["traceEvents"])
    assert "aten::addmm" in (tmp_path / "profile" / "ops_rank0.txt").read_text()
    assert "## Top profiled ops" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("text", ["5-2", "0-3", "fast", "3:5"])
def test_a_profile_range_that_is_not_one_is_a_one_line_error(text, tmp_path):
    with pytest.raises(at.ConfigError, match="profile_steps="):
        at.train("vae", max_steps=4, profile_steps=text, output_dir=str(tmp_path), show_progress_bar=False)


@pytest.mark.multiprocess
def test_every_process_writes_its_own_trace(tmp_path):
    train_and_dump("cpu_ddp", tmp_path, "vae", "max_steps=3", "profile_steps=2", "eval_every_steps=0", world_size=2)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "ops_rank0.txt", "ops_rank1.txt", "profile_0.json", "profile_1.json"]  # fmt: skip

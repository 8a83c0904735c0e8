"""Several runs in one launch: `at.train(keep_process_group=True)` and the test suite's layout launches.

The suite trains most multi-process scenarios as requests to one long-lived launch per layout (conftest's
`LayoutLaunches`), which rests on one promise: a run trained after others in the same process group follows
exactly the trajectory it follows in a fresh launch. Here a GPT run and a VAE run with other settings go first
(another recipe, precision of the data path, accumulation and checkpoints), and the scenario under test second;
its losses, evaluation, exported weights and each rank's parameters must equal a fresh launch's, bitwise, on
DDP and FSDP. A scenario that fails ends its launch with the error in the test's message, and the next request
starts a fresh launch.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    TEST_OVERRIDES,
    WORKERS,
    LayoutLaunches,
    accelerate_launch,
    dump_env,
    final_parameters,
    rank_parameters,
    rank_summary,
    read_metrics,
)

pytestmark = pytest.mark.multiprocess

SCENARIO = [
    "max_steps=6",
    "global_batch_size=32",
    "micro_batch_size=8",
    "log_every_steps=1",
    "eval_every_steps=3",
    "num_prefetch_batches=2",
    "save_every_steps=3",
    "warmup_steps=2",
]
BEFORE = [
    (
        "gpt",
        [
            "max_steps=3",
            "n_layer=1",
            "n_head=2",
            "d_model=16",
            "block_size=16",
            "max_source_bytes=100000",
            "global_batch_size=8",
            "micro_batch_size=4",
            "eval_every_steps=0",
        ],
    ),
    (
        "vae",
        [
            "max_steps=4",
            "global_batch_size=32",
            "micro_batch_size=16",
            "lr=0.01",
            "seed=7",
            "ema_decay=0.9",
            "eval_every_steps=0",
        ],
    ),
]


def test_a_scenario_trained_after_others_in_one_launch_equals_a_fresh_launch_bitwise(tmp_path):
    """On FSDP, whose sharded state is the most a scenario could leave behind for the next (cpu_ddp, also run
    that way by many tests, was checked the same way until CI's time ran short)."""
    layout = "cpu_fsdp"
    launches = LayoutLaunches()
    try:
        for number, (recipe, overrides) in enumerate(BEFORE):
            out = tmp_path / f"before{number}"
            launches.train(layout, out, recipe, [f"output_dir={out}", *overrides, *TEST_OVERRIDES], world_size=2)
        later = tmp_path / "later"
        launches.train(layout, later, "vae", [f"output_dir={later}", *SCENARIO, *TEST_OVERRIDES], world_size=2)
        assert len(launches.launches) == 1 and next(iter(launches.launches.values()))["requests"] == 3
    finally:
        launches.end_all()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    accelerate_launch(
        layout, WORKERS / "train_and_dump.py", "vae", f"output_dir={fresh}", *SCENARIO, env=dump_env(fresh, 2)
    )

    def without_times(records: list[dict]) -> list[dict]:
        measured = ("seconds", "time", "per_s", "eta_s", "wait_frac", "tflops", "rss")
        return [{k: v for k, v in r.items() if not any(word in k for word in measured)} for r in records]

    assert without_times(read_metrics(later)) == without_times(read_metrics(fresh))
    for name, tensor in final_parameters(fresh).items():
        assert torch.equal(final_parameters(later)[name], tensor), name
    for rank in (0, 1):
        assert rank_summary(later, rank) == rank_summary(fresh, rank)
        later_parameters, fresh_parameters = rank_parameters(later, rank), rank_parameters(fresh, rank)
        assert later_parameters.keys() == fresh_parameters.keys()
        for name, tensor in fresh_parameters.items():
            assert torch.equal(later_parameters[name], tensor), name


def test_a_refused_scenario_is_said_and_served_on_while_a_failed_one_fails_its_test_and_gets_a_fresh_launch(tmp_path):
    launches = LayoutLaunches()
    try:
        out = tmp_path / "refused"
        refusal = launches.train("cpu_ddp", out, "vae", [f"output_dir={out}", "max_steps=2", "global_batch_size=32",
                                 "micro_batch_size=7", *TEST_OVERRIDES], world_size=2)  # fmt: skip
        assert refusal is not None and "micro_batch_size=7" in refusal and "\n" not in refusal
        assert launches.launches  # every process refused alike: the launch serves the next scenario
        out = tmp_path / "crashed"
        with pytest.raises(AssertionError, match="failed on cpu_ddp"):
            launches.train("cpu_ddp", out, "vae_crash_once", [f"output_dir={out}", "max_steps=2",
                           "crash_at_micro_batch=1", *TEST_OVERRIDES], world_size=2)  # fmt: skip
        assert not launches.launches
        good = tmp_path / "good"
        launches.train("cpu_ddp", good, "vae", [f"output_dir={good}", "max_steps=2", *TEST_OVERRIDES], world_size=2)
        assert [r["step"] for r in read_metrics(good) if "loss" in r][-1] == 2
    finally:
        launches.end_all()

"""compile=true: torch.compile through accelerate's regional compilation, the same trajectory as eager.

On the CPU (inductor, a C++ compiler): the GPT compiled follows the eager run's losses and gradient norms to
fp32 tolerance, its checkpoint keeps the uncompiled names (it resumes without compile and its final weights load
into a plain model), and the log carries the count of compiled graphs. The rules: which plugin a layout gets
(the accelerate config's dynamo_backend turns it on too), a one-line error beside TP or a pipeline, and the
warning when graphs keep being compiled.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import DynamoBackend
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import accel_trainer as at
from accel_trainer import LayoutError
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.parallel.compiling import (
    RECOMPILES_PER_REGION,
    WARN_AFTER_LOG_STEPS,
    CompileWatch,
    allow_recompiles_per_region,
    dynamo_plugin,
)
from conftest import final_parameters, read_metrics


def test_compile_is_off_by_default_and_regional_inductor_when_asked(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    assert dynamo_plugin(LayoutSettings()).backend == DynamoBackend.NO
    plugin = dynamo_plugin(LayoutSettings(compile=True))
    assert plugin.backend == DynamoBackend.INDUCTOR and plugin.use_regional_compilation


def test_the_accelerate_configs_dynamo_backend_turns_regional_compilation_on(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    plugin = dynamo_plugin(LayoutSettings())
    assert plugin.backend == DynamoBackend.INDUCTOR and plugin.use_regional_compilation


@pytest.mark.parametrize("settings", [{"tp_size": 2}, {"pp_size": 2}])
def test_compile_beside_tensor_or_pipeline_parallelism_is_a_one_line_error(monkeypatch, settings):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    with pytest.raises(LayoutError, match="compile=true with tensor or pipeline parallelism"):
        dynamo_plugin(LayoutSettings(compile=True, **settings))


def test_graphs_still_compiled_after_the_first_log_steps_are_warned_about_once(monkeypatch):
    monkeypatch.setitem(counters["stats"], "unique_graphs", 4)
    watch = CompileWatch(enabled=True, warn=True)
    for step in range(1, WARN_AFTER_LOG_STEPS + 1):  # the first shapes, then dynamic ones: expected
        assert watch.record(step) == {"compiled_graphs": 4}
    counters["stats"]["unique_graphs"] = 6
    with pytest.warns(UserWarning, match="compiled 2 new graph"):
        watch.record(10)
    counters["stats"]["unique_graphs"] = 7
    assert watch.record(11) == {"compiled_graphs": 7}  # no second warning (pytest would fail on one)
    assert CompileWatch(enabled=False, warn=True).record(1) == {}


GPT = dict(n_layer=2, n_head=2, d_model=32, block_size=64, max_source_bytes=200_000, max_steps=6,
           global_batch_size=8, micro_batch_size=4, log_every_steps=2, eval_every_steps=3, save_every_steps=3,
           show_progress_bar=False, report=False)  # fmt: skip


def test_canary_modules_compiled_separately_share_one_dynamo_cache():
    """Why allow_recompiles_per_region exists: when this fails, each compiled region has a cache of its own and
    the raised limit can go."""
    torch._dynamo.reset()
    for module in (torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)):
        torch.compile(module, backend="eager")(torch.randn(2, 3))
    shared = torch._dynamo.external_utils.wrap_inline(lambda: None).__code__
    assert len(_debug_get_cache_entry_list(shared)) == 2
    torch._dynamo.reset()


def test_every_compiled_region_gets_dynamos_default_allowance():
    # dynamo's own patch, not monkeypatch: undoing a monkeypatch deletes the setting, which hides it from every
    # later torch.compile in the process ("recompile_limit does not exist")
    with torch._dynamo.config.patch(recompile_limit=8):
        model = torch.nn.Sequential(*(torch.compile(torch.nn.Linear(2, 2), backend="eager") for _ in range(3)))
        allow_recompiles_per_region(model)
        assert torch._dynamo.config.recompile_limit == 3 * RECOMPILES_PER_REGION
    assert torch._dynamo.config.recompile_limit == 8


def test_a_compiled_gpt_follows_the_eager_trajectory_and_saves_plain_names(tmp_path):
    at.train("gpt", **GPT, output_dir=str(tmp_path / "eager"))
    at.train("gpt", **GPT, compile=True, output_dir=str(tmp_path / "compiled"))
    eager, compiled = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    for key in ("loss", "grad_norm", "eval/loss"):
        got, want = ([r[key] for r in records if key in r] for records in (compiled, eager))
        assert len(got) == len(want) > 0 and got == pytest.approx(want, rel=1e-5), key
    assert all(r["compiled_graphs"] > 0 for r in compiled if "loss" in r)
    weights, reference = final_parameters(tmp_path / "compiled"), final_parameters(tmp_path / "eager")
    assert weights.keys() == reference.keys() and not any("_orig_mod" in name for name in weights)
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=1e-5)
    # The compiled run's checkpoint resumes without compile.
    at.train("gpt", **GPT, output_dir=str(tmp_path / "resumed"),
             resume=str(tmp_path / "compiled" / "checkpoints" / "step_00000003"))  # fmt: skip
    resumed = final_parameters(tmp_path / "resumed")
    for name in reference:
        torch.testing.assert_close(resumed[name], weights[name], rtol=1e-4, atol=1e-5)

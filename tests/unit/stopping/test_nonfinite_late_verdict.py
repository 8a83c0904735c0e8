"""The non-finite guard's verdict read a step late: where the optimizers skip a step on the device (torch's fused
kernels and their `found_inf`), a step is taken before its verdict is read, and the run is bitwise the run that
reads every verdict before its step (stopping/nonfinite.py, optim/device_skip.py).

Each comparison trains the `poisoned` recipe (tests/workers/recipes: a BatchNorm classifier whose chosen
micro-batches are NaN) twice: as it comes (fused AdamW: read late) and with its AdamW saying it cannot skip on the
device (`optimizer_skips_on_device=false`: every verdict read at once, the path the guard always took). Log steps
are read at once on both, so the runs log rarely; every step is saved, so every checkpoint is compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

import accel_trainer as at
from accel_trainer.optim.device_skip import DeviceSkip, skips_on_device
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.stopping.nonfinite import NonfiniteSteps
from conftest import WORKERS, assert_bitwise, read_metrics, train_and_dump

QUIET = dict(show_progress_bar=False, report=False, eval_every_steps=0)
SAVED = dict(save_every_steps=1, keep_last=0)
# What a record says about the training (its timings and memory differ from run to run).
TRAINING_KEYS = ("step", "epoch", "loss", "lr", "grad_norm", "nonfinite_steps", "samples_seen", "items_seen")


@pytest.fixture(autouse=True, scope="module")
def poisoned_recipe():
    at.registry.discover_recipes([WORKERS / "recipes"])


def late_steps(run: Path, rank: int = 0) -> int:
    """How many optimizer steps of the run were taken before their verdict was read (the recipe counts them)."""
    counted = run / f"late_steps_rank{rank}.txt"
    return int(counted.read_text()) if counted.exists() else 0


def assert_same_runs(late: Path, at_once: Path, steps: range) -> None:
    """Every checkpoint of `steps` holds the same files bit for bit, the same counts and positions, and the runs
    logged the same records."""
    for step in steps:
        folders = [run / "checkpoints" / f"step_{step:08d}" for run in (late, at_once)]
        names = sorted(path.name for path in folders[0].glob("*.safetensors"))
        assert names == sorted(path.name for path in folders[1].glob("*.safetensors")), step
        for name in names:
            assert_bitwise(*(load_file(str(folder / name)) for folder in folders))
        states = [json.loads((folder / "train_state.json").read_text()) for folder in folders]
        for state in states:
            state.update(config=None, config_hash=None, metrics={k: state["metrics"].get(k) for k in TRAINING_KEYS})
        assert states[0] == states[1], step
    records = [
        [{k: r.get(k) for k in TRAINING_KEYS} for r in read_metrics(run) if "lr" in r] for run in (late, at_once)
    ]
    assert records[0] == records[1]


def last_record(run: Path) -> dict:
    return [r for r in read_metrics(run) if "lr" in r][-1]


@pytest.mark.parametrize(
    "case, skipped",
    [
        (dict(poison="input", poison_steps="3,5,6", ema_decay=0.9), 3),  # NaN statistics, gradients, loss; an EMA
        (dict(poison="loss", poison_steps="2,7"), 2),  # a NaN loss with finite gradients
        (dict(poison="input", poison_steps="3,8,9", global_batch_size=16), 3),  # 2 micro-batches a step: 2, 4, 5
    ],
    ids=["input-ema", "loss", "accumulation"],
)
def test_steps_read_late_train_bitwise_as_steps_read_at_once(tmp_path, case, skipped):
    common = dict(max_steps=10, log_every_steps=4, **SAVED, **QUIET, **case)
    at.train("poisoned", output_dir=str(tmp_path / "late"), **common)
    at.train("poisoned", optimizer_skips_on_device=False, output_dir=str(tmp_path / "at_once"), **common)

    assert (late_steps(tmp_path / "late"), late_steps(tmp_path / "at_once")) == (6, 0)  # 1, 4, 8, 10 at once
    assert_same_runs(tmp_path / "late", tmp_path / "at_once", range(1, 11))
    assert last_record(tmp_path / "late")["nonfinite_steps"] == skipped


def test_a_streak_read_late_stops_and_resumes_as_one_read_at_once(tmp_path):
    """Steps 5 and 6 are read late; step 7, the third in a row, could stop the run and is read at once. A resume
    from step 6's checkpoint (saved while step 6 was pending) continues the streak; one from the stop's (step 7)
    starts a new allowance and reads its steps late again."""
    runs = {"late": {}, "at_once": {"optimizer_skips_on_device": False}}
    for name, extra in runs.items():
        with pytest.raises(NonfiniteSteps, match=r"steps 5-7 \(3 in a row.*holds the weights of step 4"):
            at.train("poisoned", poison_steps="5,6,7", max_nonfinite_in_a_row=3, log_every_steps=0,
                     output_dir=str(tmp_path / name), **extra, **SAVED, **QUIET)  # fmt: skip
        resumed = str(tmp_path / name / "checkpoints")
        with pytest.raises(NonfiniteSteps, match=r"steps 5-7 \(3 in a row"):
            at.train("poisoned", poison_steps="1", max_nonfinite_in_a_row=3, log_every_steps=0,
                     output_dir=str(tmp_path / name / "cut"), resume=f"{resumed}/step_00000006", **extra, **SAVED,
                     **QUIET)  # fmt: skip
        at.train("poisoned", poison_steps="2", max_nonfinite_in_a_row=3, log_every_steps=0,
                 output_dir=str(tmp_path / name / "on"), resume=f"{resumed}/step_00000007", **extra, **SAVED,
                 **QUIET)  # fmt: skip

    assert (late_steps(tmp_path / "late"), late_steps(tmp_path / "at_once")) == (5, 0)  # steps 2-6
    assert_same_runs(tmp_path / "late", tmp_path / "at_once", range(1, 8))
    assert_same_runs(tmp_path / "late" / "on", tmp_path / "at_once" / "on", range(8, 11))
    assert last_record(tmp_path / "late" / "on")["nonfinite_steps"] == 4


def count_verdict_reads(monkeypatch) -> list[str]:
    """Every tensor read back to the host (item, tolist, float, bool) by accel_trainer's code, but evaluation's."""
    package, reads = Path(at.__file__).parent, []
    for method in ("item", "tolist", "__float__", "__bool__"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename)
            if caller.is_relative_to(package) and caller.name != "evaluator.py":
                reads.append(f"{_method} in {caller.relative_to(package)}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return reads


@pytest.mark.parametrize("limit", [5, 1])
def test_an_optimizer_step_does_not_wait_for_its_own_verdict(tmp_path, monkeypatch, limit):
    """The canary of the late path: one read a step, and each step but the first (its optimizer state is made
    then) and the last (a log step) is taken when only the verdicts before it have been read. With
    max_nonfinite_in_a_row=1 any step could end the run, so every verdict is read before its step."""
    reads = count_verdict_reads(monkeypatch)
    reads_before_steps: list[int] = []
    handle = register_optimizer_step_pre_hook(lambda *_: reads_before_steps.append(len(reads)))
    try:
        at.train("poisoned", max_steps=8, log_every_steps=0, max_nonfinite_in_a_row=limit, output_dir=str(tmp_path),
                 **QUIET)  # fmt: skip
    finally:
        handle.remove()

    late = [1, 1, 2, 3, 4, 5, 6, 8]  # step k is taken after k - 1 verdicts
    assert reads_before_steps == (late if limit > 1 else list(range(1, 9)))
    assert reads[:8] == ["item in stopping/nonfinite.py"] * 8  # then the last step's log record


@pytest.mark.multiprocess
def test_on_two_processes_a_nan_on_one_read_late_is_skipped_as_one_read_at_once(tmp_path):
    """Process 1's loss alone is NaN at step 5 (a detached term): the verdict reaches process 0 through the
    all-reduce on the device, and both skip the step without reading it first."""
    common = ["poison_steps=5", "poison=loss", "poison_rank=1", "global_batch_size=16", "log_every_steps=0",
              "ema_decay=0.9", *(f"{k}={v}" for k, v in {**SAVED, **QUIET}.items())]  # fmt: skip
    train_and_dump("cpu_ddp", tmp_path / "late", "poisoned", *common, world_size=2)
    train_and_dump("cpu_ddp", tmp_path / "at_once", "poisoned", *common, "optimizer_skips_on_device=false",
                   world_size=2)  # fmt: skip

    assert_same_runs(tmp_path / "late", tmp_path / "at_once", range(1, 11))
    assert [late_steps(tmp_path / "late", rank) for rank in (0, 1)] == [8, 8]  # all but the first and the last
    saved = [load_file(str(tmp_path / f"late/checkpoints/step_0000000{step}/model.safetensors")) for step in (4, 5)]
    assert_bitwise(*saved)
    assert last_record(tmp_path / "late")["nonfinite_steps"] == 1


# -- the parts, on the CPU and CUDA ------------------------------------------------------------------------------
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=ON_GPU)]


def parameters(device: str = "cpu") -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3, device=device)), torch.nn.Parameter(torch.randn(3, device=device))]


def test_only_torchs_fused_optimizers_with_their_own_step_skip_on_the_device():
    class Logged(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    class Renamed(torch.optim.AdamW):
        pass

    skipping = [torch.optim.AdamW(parameters(), fused=True), torch.optim.Adam(parameters(), fused=True),
                torch.optim.SGD(parameters(), lr=0.1, fused=True), torch.optim.Adagrad(parameters(), fused=True),
                Renamed(parameters(), fused=True)]  # fmt: skip
    not_skipping = [torch.optim.AdamW(parameters(), foreach=True), torch.optim.AdamW(parameters(), foreach=False),
                    torch.optim.SGD(parameters(), lr=0.1), Logged(parameters(), fused=True)]  # fmt: skip
    assert [skips_on_device(o) for o in skipping] == [True] * 5
    assert [skips_on_device(o) for o in not_skipping] == [False] * 4


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, fused=True),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),  # fused on the CPU only
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_skipped_on_the_device_changes_no_parameter_and_no_state(name, device):
    if name == "adagrad" and device == "cuda":
        pytest.skip("torch's fused Adagrad runs on the CPU only")
    params = parameters(device)
    optimizer = OPTIMIZERS[name](params)
    skip = DeviceSkip([optimizer])
    for parameter in params:
        parameter.grad = torch.ones_like(parameter)
    assert skip.ready() == (name == "adagrad")  # Adagrad makes its state when built, the others at their first step
    optimizer.step()
    assert skip.ready()
    weights = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)} for p in params}
    for parameter in params:
        parameter.grad = torch.full_like(parameter, float("nan"))

    with skip.unless(torch.tensor(False, device=device)):
        optimizer.step()

    assert all(torch.equal(w, p) for w, p in zip(weights, params, strict=True))
    for p in params:
        assert_bitwise(state[id(p)], {k: v for k, v in optimizer.state[p].items() if torch.is_tensor(v)})
    assert not hasattr(optimizer, "found_inf")
    for parameter in params:
        parameter.grad = torch.ones_like(parameter)
    with skip.unless(torch.tensor(True, device=device)):
        optimizer.step()
    assert not torch.equal(weights[0], params[0])  # a finite verdict steps


def test_sgd_without_momentum_has_no_state_to_wait_for():
    params = parameters()
    for parameter in params:
        parameter.grad = torch.ones_like(parameter)
    assert DeviceSkip([torch.optim.SGD(params, lr=0.1, fused=True)]).ready()


@pytest.mark.parametrize("device", DEVICES)
def test_the_ema_follows_a_device_verdict_bitwise(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300)).to(device)
    immediate, late = WeightAverage(model, 0.9), WeightAverage(model, 0.9)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))

    before = {name: tensor.clone() for name, tensor in late.average.items()}
    late.update(taken=torch.tensor(False, device=device))
    assert_bitwise(before, late.average)
    immediate.update()  # torch's own EMA update
    late.update(taken=torch.tensor(True, device=device))
    assert_bitwise(immediate.average, late.average)
    assert not torch.equal(before["0.weight"], late.average["0.weight"])


# -- whole runs on CUDA (scripts/gpu_check.sh) ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_steps_read_late_train_bitwise_as_steps_read_at_once(tmp_path):
    """The first comparison above on the GPU: the fused CUDA kernels' skip, the pinned copy and its event."""
    common = dict(max_steps=10, log_every_steps=4, poison_steps="3,5,6", ema_decay=0.9, **SAVED, **QUIET)
    at.train("poisoned", output_dir=str(tmp_path / "late"), **common)
    at.train("poisoned", optimizer_skips_on_device=False, output_dir=str(tmp_path / "at_once"), **common)

    assert last_record(tmp_path / "late")["mem_allocated_gb"] > 0  # trained on the GPU
    assert (late_steps(tmp_path / "late"), late_steps(tmp_path / "at_once")) == (6, 0)
    assert_same_runs(tmp_path / "late", tmp_path / "at_once", range(1, 11))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_guard_makes_no_synchronisation_between_log_steps(tmp_path):
    """torch's sync debug mode names every host-device synchronisation: five more steps between log steps add
    none, with the guard on (its verdicts read a step late, behind an event)."""
    import warnings

    package = str(Path(at.__file__).parent)

    def syncs(steps: int) -> list[str]:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                at.train("gpt", n_layer=1, d_model=64, block_size=64, max_steps=steps, log_every_steps=0,
                         mixed_precision="bf16", output_dir=str(tmp_path / str(steps)), **QUIET)  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode(0)
        found = sorted(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        print(f"{steps} steps: {len(found)} synchronisations, from {sorted(set(found))}")
        return [sync for sync in found if sync.startswith(package)]

    assert syncs(8) == syncs(3)

"""`mlp_slow`: the mlp recipe with its set-up, steps or evaluations slowed on request, for the signal tests
(test_preemption.py, test_signals_in_a_terminal.py).

The delays come from environment variables, not config fields, so a slowed run that is interrupted and the
fast run that resumes it (or an uninterrupted reference run) are the same run to `resume=auto`:
- ACCEL_TEST_SLOW_SETUP_S: `build_datasets` sleeps this long, inside the set-up (after the rendezvous, before
  any step), having written the marker `setup.rank<r>`;
- ACCEL_TEST_SLOW_STEP_S: every training forward sleeps this long (a slow step, as on a loaded machine);
- ACCEL_TEST_SLOW_EVAL_S: every evaluation batch after step 0 sleeps this long, having written `eval.rank<r>`.
Markers are empty files in ACCEL_TEST_MARKERS (none when it is unset): a test waits for one, then signals.
"""

import os
import time
from pathlib import Path

import accel_trainer as at
from accel_trainer.stopping.signals import where

Mlp = at.get_recipe("mlp")


def _seconds(variable: str) -> float:
    return float(os.environ.get(variable, "0"))


def mark(phase: str) -> None:
    """Write the marker `<phase>.rank<r>`: this process has reached `phase`."""
    if os.environ.get("ACCEL_TEST_MARKERS"):
        Path(os.environ["ACCEL_TEST_MARKERS"], f"{phase}.rank{os.environ.get('RANK', '0')}").touch()


@at.register_recipe("mlp_slow")
class SlowMlp(Mlp):
    """mlp with sleeps in its set-up, steps and evaluations (ACCEL_TEST_SLOW_*_S)."""

    def build_datasets(self, cfg):
        if _seconds("ACCEL_TEST_SLOW_SETUP_S"):
            mark("setup")
            time.sleep(_seconds("ACCEL_TEST_SLOW_SETUP_S"))
        return super().build_datasets(cfg)

    def compute_loss(self, model, batch):
        time.sleep(_seconds("ACCEL_TEST_SLOW_STEP_S"))
        return super().compute_loss(model, batch)

    def eval_metrics(self, model, batch):
        if _seconds("ACCEL_TEST_SLOW_EVAL_S") and where().startswith("the evaluation after step"):
            mark("eval")
            time.sleep(_seconds("ACCEL_TEST_SLOW_EVAL_S"))
        return super().eval_metrics(model, batch)

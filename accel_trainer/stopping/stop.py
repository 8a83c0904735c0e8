"""Whether a run ends after this step, for one of three reasons, asked once per step and answered as one `Stop`.

- non-finite: `max_nonfinite_in_a_row` steps in a row were NaN or Inf (stopping/nonfinite.py): an error, exit 2;
- preempted: a stop signal or a spent `max_time` (stopping/signals.py): `Preempted`, exit 75;
- early stop: `early_stop_metric` stopped improving (stopping/early.py): the run ends normally.

Every reason is asked every step in the same order on every process, since the signal check is a collective;
the run saves a checkpoint at the step first, then `end` raises or returns. When several hold, the first in
the list above is the one reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.observe.observer import Observer
from accel_trainer.stopping.early import EarlyStopping
from accel_trainer.stopping.nonfinite import NonfiniteGuard
from accel_trainer.stopping.signals import Preempted, PreemptionWatcher


@dataclass(frozen=True)
class Stop:
    """Why the run ends after its current step."""

    reason: Literal["nonfinite", "preempted", "early"]
    line: str = ""  # the early stop's one line


class Stopping:
    """The three reasons to end a run early, owned together; a context that watches for signals while it runs."""

    def __init__(
        self,
        cfg: TrainConfig,
        guard: NonfiniteGuard | None,
        early: EarlyStopping,
        preemption: PreemptionWatcher,
    ) -> None:
        self.cfg, self.guard, self.early, self.preemption = cfg, guard, early, preemption

    def __enter__(self) -> Stopping:
        self.preemption.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.preemption.__exit__(*exc_info)

    def gives_up(self) -> bool:
        """Whether the non-finite guard ends the run at this step (known before its training record is written)."""
        return self.guard is not None and self.guard.gives_up()

    def after_step(self, step: int, scores: dict[str, Any] | None) -> Stop | None:
        """The reason the run ends after `step`, or None (notes an evaluation for early stopping)."""
        early = self.early.after_evaluation(self.cfg, step, scores)
        signalled = self.preemption.should_stop()  # a collective: asked at every step on every process
        if self.gives_up():
            return Stop("nonfinite")
        if signalled:
            return Stop("preempted")
        return Stop("early", early) if early else None

    def end(self, stop: Stop, step: int, checkpoint: Any, observer: Observer) -> None:
        """Record the stop, then raise its error with the checkpoint the run just saved; an early stop says its
        line and returns."""
        if stop.reason == "nonfinite":
            assert self.guard is not None
            observer.event("nonfinite_stop", step=step)
            raise self.guard.error(step, checkpoint)
        if stop.reason == "preempted":
            observer.event("preempted", step=step, signal=self.preemption.signal_name)
            raise Preempted(self.preemption.signal_name, step, checkpoint)
        observer.event("early_stop", step=step)
        observer.note(f"accel-trainer: {stop.line}; checkpoint {checkpoint}")

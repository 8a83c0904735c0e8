"""Checkpointing, owned in one place: the run's progress, when to save, what to keep, where to resume.

The states it saves are registered once, when it is built (checkpoint/train_state.py). The loop then asks it
two things: `restore()` once at start (choose the resume point, load it into the prepared objects and the
states) and `after_step(stop, scores)` after each optimizer step (save if the cadence, the end of the run, a
stop signal or a new best evaluation asks for it). Everything else is here: async writes, retention, keep-best,
and the RNG states, whose restoration the data path times (`resume_rng`).

keep-best sees every evaluation: when one gives a new best `keep_best_metric` off the save cadence, a
checkpoint is saved at that step, so the best model is always on disk. The metric must be an eval metric
(`eval/<name>` from the recipe's `eval_metrics`); a name the first evaluation does not return is a one-line
error then, and the first evaluation is the step-0 baseline (keep-best needs `eval_every_steps` > 0).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from accel_trainer.checkpoint import files, restore, save
from accel_trainer.checkpoint.train_state import SavedFields, Stateful, TrainState, saved_states
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.checkpoint.writer import BackgroundWriter
from accel_trainer.config.eval_settings import check_measurable, metric_of
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.data.rng import apply_rng_states
from accel_trainer.parallel.batchnorm import average_running_stats


@dataclass
class KeepBest(SavedFields):
    """The best `keep_best_metric` so far and the checkpoint folder that holds it: the checkpointer's own state."""

    best_metric: float | None = None
    best_checkpoint: str | None = None


class Checkpointer:
    """Saves, keeps and restores the checkpoints of one run: the prepared objects (`trained`) and the states
    registered here once, when it is built (checkpoint/train_state.py): the run's progress, its own keep-best,
    then `states` in order (the non-finite guard's counts, early stopping's, the items seen, the data position)."""

    def __init__(
        self,
        accelerator: Accelerator,
        run_dir: Path,
        trained: Trained,
        identity: RunIdentity,
        *,
        has_eval: bool,
        progress: TrainState,
        states: tuple[Stateful, ...] = (),
    ) -> None:
        check_keep_best(identity.cfg, has_eval)
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.trained = trained
        self.identity = identity
        self.cfg = identity.cfg
        self.progress = progress
        self.best = KeepBest()
        self.states: tuple[Stateful, ...] = (progress, self.best, *states)
        self.resume_rng: Callable[[], None] | None = None
        """Applies the saved RNG states; the data path calls it at the moment the uninterrupted run was at."""
        self.writer = BackgroundWriter(identity.layout.collective_timeout_s) if self.cfg.async_save else None

    def restore(self) -> None:
        """Load the checkpoint `resume` names, if any, into the prepared objects and the registered states; a
        state refuses a saved value this run cannot continue from (a stream position) before anything is loaded."""
        folder = resume_point(self.accelerator, self.cfg, self.run_dir)
        if folder is None:
            return
        rng_states = restore.restore(self.accelerator, folder, self.trained, self.identity, self.states)
        if self.accelerator.is_main_process:
            print(f"resuming from {folder} at step {self.progress.step}", flush=True)
        if rng_states:
            self.resume_rng = functools.partial(apply_rng_states, rng_states)

    def after_step(self, stop: bool, scores: dict[str, float] | None) -> Path | None:
        """Save the checkpoint of the progress's step if it is due; return its folder, or None.

        Due: on a stop signal, at `max_steps`, every `save_every_steps`, and when `scores` (this step's
        evaluation) hold a new best `keep_best_metric`. Every process asks the registered states for theirs (the
        items still on the device and a split stream's position are collectives, which a save, itself
        collective, can afford).
        """
        step, cfg = self.progress.step, self.cfg
        new_best = self._note_best(scores)
        if step == 0:  # the baseline evaluation: nothing trained yet, nothing to save
            return None
        cadence = cfg.save_every_steps > 0 and step % cfg.save_every_steps == 0
        if not (stop or new_best or cadence or step == cfg.max_steps):
            return None
        recorded = saved_states(self.states)
        average_running_stats(self.accelerator, self.trained.model)  # the saved statistics are those evaluated
        best = self.best.best_checkpoint
        keep = files.checkpoints_dir(self.run_dir) / best if best else None
        return save.save(
            self.accelerator,
            self.run_dir,
            recorded,
            self.trained,
            self.identity,
            writer=self.writer,
            after_publish=functools.partial(files.apply_retention, self.run_dir, cfg.keep_last, keep),
        )

    def close(self) -> None:
        """Wait for a background write: never leave with a checkpoint half written (raises its failure)."""
        if self.writer is not None:
            self.writer.close()

    def before_update(self) -> None:
        """Called before an optimizer step changes the weights: a sharded background save's copy of them to host
        memory, which overlaps the step's forward and backward, must be done by then."""
        if self.writer is not None:
            self.writer.wait_for_staging()

    def background_writes(self) -> list[dict[str, float]]:
        """The background writes finished since the last call (step, write_s, written_at, and waited_s: how long
        training waited for it at the next save or at the end), for events.jsonl."""
        if self.writer is None:
            return []
        finished, self.writer.finished = self.writer.finished, []
        return finished

    def _note_best(self, scores: dict[str, float] | None) -> bool:
        """Record a new best `keep_best_metric` among `scores`; whether there was one (never at step 0)."""
        name, best = self.cfg.keep_best_metric, self.best
        if not name or scores is None:
            return False
        value = metric_of("keep_best_metric", name, scores)
        better = math.isfinite(value) and (  # NaN or inf is never the best: the evaluator says so when it happens
            best.best_metric is None
            or (value < best.best_metric if self.cfg.keep_best_mode == "min" else value > best.best_metric)
        )
        if self.progress.step == 0 or not better:
            return False
        best.best_metric, best.best_checkpoint = value, files.step_folder_name(self.progress.step)
        return True


def check_keep_best(cfg: TrainConfig, has_eval: bool) -> None:
    """Refuse a keep_best_metric that could never be measured, before any training.

    Raises:
        ConfigError: not an eval metric, no eval set, or no evaluation before the end.
    """
    if cfg.keep_best_metric:
        check_measurable("keep_best_metric", cfg.keep_best_metric, cfg, has_eval)


def resume_point(accelerator: Accelerator, cfg: TrainConfig, run_dir: Path) -> Path | None:
    """The checkpoint folder `cfg.resume` names, decided on the main process and shared with the others.

    `auto` takes the newest complete checkpoint of the run folder (skipping incomplete or corrupt ones with a
    warning) or None; `none` is None; a path is a checkpoint folder (checked on load, so a broken one is a
    clear error) or a run folder, whose newest complete checkpoint is taken.
    """
    choice: list[str | None] = [None]
    if accelerator.is_main_process:
        files.remove_stale_temporaries(run_dir)
        if cfg.resume == "auto":
            found = files.newest_valid_checkpoint(run_dir)
            choice[0] = str(found) if found else None
        elif cfg.resume != "none":
            path = Path(cfg.resume)
            if files.checkpoints_dir(path).is_dir():
                found = files.newest_valid_checkpoint(path)
                choice[0] = str(found) if found else str(path)
            else:
                choice[0] = str(path)
    if accelerator.num_processes > 1:
        broadcast_object_list(choice)
    return Path(choice[0]) if choice[0] else None

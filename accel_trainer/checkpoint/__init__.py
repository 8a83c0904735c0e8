"""Checkpoints without pickle: what they hold, saving and restoring on any layout, their files on disk,
exports and the run folder they live in.

Owner: `checkpointer.Checkpointer`, built once with the states it saves (`train_state.py`); the loop asks it to
`restore()` and, after each step, `after_step(stop, scores)`. `export.export` and `run_folder` serve the commands.
"""

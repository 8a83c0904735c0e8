"""The reasons a run ends before `max_steps`: a stop signal or a spent `max_time`, early stopping on an eval
metric, and a run of non-finite steps.

Owner: `stop.Stopping`, asked once per step (`after_step`); `signals.catch_stop_signals` is installed first thing
by every entry point, `nonfinite.NonfiniteGuard` and `early.EarlyStopping` own their counts.
"""

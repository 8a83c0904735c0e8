"""The reasons a run ends before `max_steps`: a stop signal or a spent `max_time`, early stopping on an eval
metric, and a run of non-finite steps.
"""

"""`accel-trainer doctor`: is this machine ready to run a layout? A command, the workers it launches, verdicts.

Entry point: `command.doctor`.
"""

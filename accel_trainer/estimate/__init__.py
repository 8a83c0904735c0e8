"""`accel-trainer estimate`: each process's memory on any layout, planned on a CPU with fake tensors (command.py).

Entry point: `command.estimate_command` (and `command.estimate` from Python).
"""

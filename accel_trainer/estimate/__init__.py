"""`accel-trainer estimate`: each process's memory on any layout, planned on a CPU with fake tensors (command.py)."""

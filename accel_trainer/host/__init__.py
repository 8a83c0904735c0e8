"""The host process a command trains in: the C allocator under it (tcmalloc or jemalloc where installed).

Entry point: `allocator.run_under_fast_allocator`, which the `accel-trainer` command calls first thing;
`allocator.in_use` says what a process runs on (run_info.json, engine/heap.py).
"""

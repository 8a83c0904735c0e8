"""What a run says about itself: the start header, metrics.jsonl and events, the log window, trackers,
FLOPs and MFU, the profiler and the report drawn from a run's files.
"""

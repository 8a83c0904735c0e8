"""What a run says about itself: the start header, metrics.jsonl and events, the log window, trackers,
FLOPs and MFU, the profiler and the report drawn from a run's files.

Owner: `observer.Observer`, which the loop tells what happened and which decides when a record is due;
`report.write_report_or_warn` draws a finished run.
"""

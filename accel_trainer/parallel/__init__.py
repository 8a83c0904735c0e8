"""How a layout runs: the Accelerator, the accelerate workarounds, the device mesh, FSDP, TP, CP, pipelines and
the step verbs of each layout. Knows nothing of checkpoints, data or observation.
"""

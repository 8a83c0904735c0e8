"""How a layout runs: the Accelerator, the accelerate workarounds, the device mesh, FSDP, TP, CP, pipelines and
the step verbs of each layout. Knows nothing of checkpoints, data or observation.

Entry points: `accelerator.build_accelerator` (the layout's Accelerator), `accelerator.prepare_for_training`,
`verbs.StepVerbs` (the optimizer verbs of a layout), `mesh.data_ranks` (what the data path divides by).
"""

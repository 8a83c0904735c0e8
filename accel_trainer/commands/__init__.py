"""The one-file commands of `accel-trainer` beside `train`: `evaluate` (the recipe's evaluation of saved
weights, and `export`), `benchmark` (`evaluate --tasks`: lm-evaluation-harness's tasks on saved weights), `sample`
(what a trained language model writes) and `new` (a recipe file from the template). The doctor and the estimate
are packages of their own (doctor/, estimate/).

Entry points (cli.py dispatches to them): `evaluate.main`, `benchmark.main` (`evaluate ... --tasks`),
`evaluate.export_run`, `sample.sample`, `new.write_new_recipe`.
"""

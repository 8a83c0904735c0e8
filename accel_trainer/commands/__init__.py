"""The one-file commands of `accel-trainer` beside `train`: `evaluate` (the recipe's evaluation of saved
weights, and `export`), `sample` (what a trained language model writes) and `new` (a recipe file from the
template). cli.py dispatches to each module's entry function. The doctor and the estimate are packages of their
own (doctor/, estimate/).
"""

"""The parts of the recipe contract (accel_trainer/recipe.py): what its methods may return, and the helpers
a recipe calls.

`losses` reads what `compute_loss` returns (and gives the exact token loss), `eval_outputs` what `eval_metrics`
returns, `batch_rows` the rows of any collated batch; `pretrained` loads a recipe's pretrained base; `shipped`
finds the recipes and layouts that ship with accel-trainer.

Entry points: `losses.read_loss_output`, `losses.token_cross_entropy`, `eval_outputs.metric_sums`,
`pretrained.load_base_model`, `shipped.recipes_folder`.
"""

"""What updates the weights: the recipe's optimizers (one, several, or alternating phases), their learning-rate
schedules and the EMA of the weights.

Entry points: `optimizers.read_optimizers` (what `build_optimizer` returned, checked and scheduled),
`schedules.recipe_scheduler`, `ema.WeightAverage`, `device_skip.DeviceSkip` (a step the non-finite guard's verdict
skips on the device). The checkpoint package saves and restores them.
"""

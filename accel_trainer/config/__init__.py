"""What a run is asked to do, typed: the recipe's config, the layout settings and how both are read from text.

A leaf over `errors`: nothing here imports torch, accelerate or another package of accel_trainer.

Entry point: `train_config.resolve_settings` (defaults, the recipe's config, a file, key=value overrides, in
that order) into a `train_config.TrainConfig` and a `layout.LayoutSettings`.
"""

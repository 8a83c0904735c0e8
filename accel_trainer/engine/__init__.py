"""The engine: the loop and what it drives, one owner each.

Entry point: `loop.train_loop`. `preparation.prepare_run` builds (with build.py) the run's parts in the order that keeps
every layout on one trajectory; `stepper.Stepper` owns one optimizer step (forward, loss, backward under
`accumulate`, the exact item normalisation, clip, step, schedule); `evaluator.Evaluator` owns evaluation and
its cadence (`due(step)`); `hf_loss` makes a transformers model's own loss exact under accumulation.
"""

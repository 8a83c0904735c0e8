"""The engine: the loop and what it drives, one owner each.

Entry point: `loop.train_loop`. `preparation.prepare_run` builds the run's parts (with build.py) in the order
that keeps every layout on one trajectory, as a `run.Run`; `stepper.Stepper` owns one optimizer step (forward,
loss, backward under `accumulate`, the exact item normalisation, clip, step, schedule); `evaluator.Evaluator`
owns evaluation and its cadence (`due(step)`), with `benchmarks` scoring lm-evaluation-harness's tasks;
`hf_loss` makes a transformers model's own loss exact under accumulation.
"""

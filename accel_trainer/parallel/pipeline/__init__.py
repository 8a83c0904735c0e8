"""Pipeline parallelism: where the model is cut, the stages run by torch's schedules, their sharding and
gradients. The state a pipeline checkpoint holds lives in `checkpoint/pipeline_state.py`, its one user.

Entry point: `build.build_pipeline`, which returns this process's `stages.Pipeline`.
"""

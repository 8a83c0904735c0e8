"""The run's data: loaders over map-style and streaming sets, batch arithmetic, column caching, prefetching.

Knows nothing of checkpoints or observation; imports `config` and `parallel` below it.
"""

"""The run's data: loaders over map-style and streaming sets, batch arithmetic, column caching, prefetching.

Knows nothing of checkpoints or observation; imports `config` and `parallel` below it.

Owner: `run_data.RunData` (a run's sets, loaders or stream, batch plan and data position), built by
engine/build.py; a recipe reads a user's files through `sources.read_data` and chats through `chat`.
"""

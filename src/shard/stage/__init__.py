"""shard.stage: a stage's compute — the executor that runs one block of layers over per-session
KV caches with early cancellation (``executor.py``, built from ``config.py``'s
``ExecutorConfig``), batching every waiting chunk into one
forward (``batch.py``), each chunk's own checks and output (``chunks.py``), the tail's rows of
features on the return path (``features.py``), the checkpoint's MTP block drafting at the
tail (``tail_drafts.py``), CUDA graphs (``graphs.py``) and its counters
(``statistics.py``). Blocking work leaves the event loop through ``shard.compute.offload``;
tensors cross the wire through ``shard.compute.tensors``. It imports the model, decode cores,
trust receipts, ``shard.compute`` and messages; never nodes, coordinator or failover.
"""

"""shard.stage: a stage's compute — the executor that runs one block of layers over per-session
KV caches with early cancellation (``executor.py``), batching every waiting chunk into one
forward (``batch.py``), each chunk's own checks and output (``chunks.py``), CUDA graphs
(``graphs.py``), its counters (``statistics.py``), torch <-> wire tensors (``tensors.py``) and
where blocking work runs (``offload.py``, the one thread boundary). It imports the model, decode
cores, trust receipts and messages; never nodes, coordinator or failover.
"""

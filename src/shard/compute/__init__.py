"""shard.compute: what every role that runs torch shares, below the roles themselves —
where blocking work runs (``offload.py``: a worker thread, or inline in virtual-time tests),
the garbage collector kept off what a node holds for good (``collector.py``; the C heap while
loading is ``shard.model.heap``), and torch tensors to and from the wire (``tensors.py``: raw
bytes, validated before anything is allocated). It imports only ``shard.messages``, torch and
trio; the stage, the drafter, the auditors and the coordinator all build on it.
"""

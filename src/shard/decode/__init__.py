"""shard.decode: what tokens to commit — pure cores with no I/O. Decoding state (``state.py``),
the target's choice and the lossless acceptance rule (``verify.py``), the speculative stream
(``speculation.py``), choosing K and D (``control.py``), draft proposers (``draft.py``,
``hybrid.py``, the feature-conditioned draft head, ``head/``, and the tail's MTP drafts as
the coordinator takes them, ``tail.py``) and the single-process
reference (``reference.py``). Training drafts is offline work, in ``shard.training``. It imports
the model runtime, messages and ``shard.compute``: never training, nodes, coordinator, failover
or the network.
"""

"""shard.decode: what tokens to commit — pure cores with no I/O. Decoding state (``state.py``),
the target's choice and the lossless acceptance rule (``verify.py``), the speculative stream
(``speculation.py``), choosing K and D (``control.py``), draft proposers (``draft.py``), the
single-process reference (``reference.py``), draft distillation (``distill/``) and the
feature-conditioned draft head (``head/``). It imports
the model runtime and messages only: never nodes, coordinator, failover or the network.
"""

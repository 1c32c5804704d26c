"""shard.spec: the typed swarm spec (TOML), read and validated in one place, one module per
table (``swarm.py`` for the nodes and limits, ``speculation.py``, ``failover.py``, ``trust.py``,
``fetch.py``; ``validate.py`` holds the shared readers). Imports nothing of the network, the
model runtime or any actor: a spec is plain data.
"""

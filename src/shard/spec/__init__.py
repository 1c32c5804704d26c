"""shard.spec: the typed swarm spec (TOML), read and validated in one place, one module per idea:
``swarm.py`` (the whole-swarm record ``SwarmSpec`` and its reader; ``swarm_table.py``: the
``[swarm]`` table's model, dtype, weights and insecure), ``nodes.py`` (the coordinator, stages,
standbys, addresses and links), ``limits.py``, ``speculation.py``, ``failover.py``,
``trust.py``, ``fetch.py``, ``audit.py``, ``api.py``, ``ledger.py`` (the receipt log),
``device.py`` (a node's device, dtype and graphs), ``reach.py`` (who accepts inbound
connections, the relay), ``formation.py`` (a ring that forms itself from ``--join`` nodes);
``validate.py`` holds the shared readers; ``layout.py`` plans a spec's ring with the pure
``shard.placement`` and applies the layout. Imports nothing of the network, the model runtime or
any actor: a spec is plain data. The records are what the actors take (``Limits``,
``FailoverSpec``, the K/D policy): no copies field by field.
"""

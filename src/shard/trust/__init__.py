"""shard.trust: who a node is and what it may prove — node keys (``identity.py``), the authority's
admission tokens (``admission.py``), the mutual handshake, per-direction keys and sealed frames
(``handshake.py``, ``channel.py``, ``sealer.py``), signed receipts (``receipts.py`` makes them,
``receipt_check.py`` checks them and reads and writes their canonical JSON file; ``ledger.py``
meters a folder of them: who computed what, refusing forged, duplicated and replayed ones), device
identity (``device.py``), canonical JSON (``canonical.py``). Spot checks, which check what a
receipt cannot (that the computation was right), are ``shard.audit``. A node's credentials are
composed from its spec where nodes are composed (``shard.nodes.compose``); trust imports neither
the spec nor the transport.
"""

"""shard.training: making drafts, offline — nothing here runs while a swarm serves, except
finding a finished draft in the cache. A small draft distilled from the target
(``distill/``: ``shard draft distill``), the draft head trained on the target's features
(``head/``: ``shard draft train``) and an EAGLE-3 head in its published layout (``eagle3/``:
``shard draft eagle3``). It builds on the runtime (``shard.decode``, the model);
the runtime never imports it.
"""

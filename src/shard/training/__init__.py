"""shard.training: making drafts, offline — nothing here runs while a swarm serves, except
finding a finished draft in the cache. A small draft distilled from the target
(``distill/``: ``shard draft distill``) and the draft head trained on the target's features
(``head/``: ``shard draft train``). It builds on the runtime (``shard.decode``, the model);
the runtime never imports it.
"""

"""shard.weights: model weights a node may trust — signed, content-addressed manifests
(``manifest.py``, ``schema.py``, ``build.py``), the chunk-verified fetch of one block
(``fetch.py``, ``plan.py``, ``store.py``) and the seeder that serves chunks (``seeder.py``). A
node's part in fetching, from its spec, is composed where nodes are (``shard.nodes.fetching``):
this package never reads a spec's nodes or builds a network.
"""

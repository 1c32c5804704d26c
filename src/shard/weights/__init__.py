"""shard.weights: model weights a node may trust — signed, content-addressed manifests
(``manifest.py``, ``schema.py``, ``build.py``), the chunk-verified fetch of one block
(``fetch.py``, ``plan.py``, ``store.py``, ``block.py``) and the seeder that serves chunks
(``seeder.py``).
"""

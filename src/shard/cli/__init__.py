"""shard.cli: the operator surface — the argument parser (``main.py``) and one module per command
family. It may import every other package; nothing imports it.
"""

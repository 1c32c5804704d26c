"""shard.observe: what an operator sees — rolling ring statistics (``ringstats.py``), the
coordinator's status feed (``status.py``) and the Textual monitor (``tui/``).
"""

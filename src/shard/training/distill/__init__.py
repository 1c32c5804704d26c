"""shard.training.distill: ``shard draft distill`` — a small draft distilled from the target,
offline (``build.py`` the recipe and its checkpoint, ``data.py`` its text and labels,
``train.py`` the loop, ``cache.py`` where drafts live and ``resolve_draft``; the command is
``shard.cli.draft``).
"""

"""shard.decode.distill: ``shard draft distill`` — a small draft distilled from the target,
offline (``build.py`` the command, ``data.py`` its text and labels, ``train.py`` the loop).
"""

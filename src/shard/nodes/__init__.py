"""shard.nodes: the composition roots. Each module wires one kind of node's actors with
channels and starts them under one nursery (``coordinator.py``; ``stage.py`` for stages and
standbys; ``seeder.py``), or a whole swarm (``inprocess.py`` inside one Trio run,
``launcher.py`` as local processes), with each node's network and credentials composed from its
spec (``compose.py``) and scripted faults on a launched swarm's processes (``script.py``). This
is the only package that wires actors; it may import every package below the CLI.
"""

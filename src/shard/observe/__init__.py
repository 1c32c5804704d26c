"""shard.observe: what an operator sees — the coordinator's status feed (``status.py``, built
from the coordinator's rolling ring statistics, ``shard.coordinator.ringstats``), device
probes (``devices.py``) and the Textual monitor (``tui/``). It never starts nodes: a monitor
that brings a swarm up is handed the start by the CLI.
"""

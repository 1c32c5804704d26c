"""shard.nodes: the composition roots. Each module wires one kind of node's actors with channels
and starts them under one nursery (``coordinator.py``, the tail's return link ending at
``return_link.py``, its HTTP API built from the spec's ``[api]`` by ``api.py``; ``stage.py`` for
stages and standbys, each holding the one frozen config its root takes from the spec,
``stage_config.py``, their blocks loaded by ``loading.py``; ``seeder.py``), or a whole swarm
(``inprocess.py`` inside one Trio run, ``launcher.py`` as local processes, waiting while they
make progress: ``startup.py``; a launched node dies with its launcher: ``lifeline.py``), a node
started with ``--join`` (``joining.py``), a standby coordinator that follows the primary and
takes over (``standby_coordinator.py``), what a node adds when its swarm audits
(``auditing.py``) and the coordinator's draft proposers (``drafter.py``). Composed from the spec
here: each node's network and credentials (``compose.py``), its part in verified fetch
(``fetching.py``), the ``weights`` a spec leaves to its checkpoint (``defaults.py``), what each
layer weighs on each node, for placement (``sizes.py``), and scripted faults on a launched
swarm's processes (``script.py``).
This is the only package that wires actors; it may import every package below the CLI.
"""

"""shard.membership: who belongs to the swarm and how far apart they are — what ring formation
(``shard.formation``) and recovery (``shard.failover``) both read.

    registry.py   the scheduler's registry: members (a node's control link, profile, roles,
                  liveness) and who holds which ring slot; ``RecoveryFailed`` when a member
                  does not carry out an order
    rtt.py        round-trip times: ``RttTracker`` on one control link, ``measure_rtt`` and
                  ``measure_row`` to peers' listen addresses, ``serve_probes`` answering them

It imports messages, specs, transport and trust; never formation or failover, which sit above
it (``tests/test_import_boundaries.py``).
"""

"""shard.formation: forming a ring from nodes started with ``--join`` (a spec with
``[formation]``) over a round-trip mesh it measures itself, kept current so that a re-plan
after a failure uses it.

    registration.py   a joining node's ``Register``, checked for shape before it is taken
    mesh.py           the latest RTT mesh between joined nodes: rows fresh, stale or dropped,
                      and who accepts inbound connections (pure bookkeeping)
    formation.py      ``Formation``: waits for the joiners, measures the mesh, plans
                      (``shard.placement``) and activates the ring; re-measures; chooses the
                      sticky re-plan after a stage died
    warm.py           a ring still running when a coordinator starts (a standby that took
                      over): adopted as it stands, its tail's return link re-dialled
    report.py         RTT reports checked, plans described in a line, ``FormationError``

It imports the member registry and RTT measurement (``shard.membership``), planning, specs,
messages, transport and trust; never recovery (``shard.failover``: its scheduler drives the
formation), which sits above it (``tests/test_import_boundaries.py``).
"""

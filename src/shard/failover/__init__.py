"""shard.failover: surviving a node that dies — the scheduler (control plane: death detection with
``detector.py``, queueing repairs, ``scheduler.py``; its spot checks, ``spotchecks.py``), its
registry of members and slots (``registry.py``), the repairs themselves (splicing standbys in,
re-dialling edges: ``splice.py``), the messages it queues and sends the coordinator's router
(``events.py``), the control links (``control.py``), a supervised ring edge with heartbeats and
deadlines (``edge.py``), the replay log of what was sent downstream (``replay.py``; spot checks
and their strikes are ``shard.audit``'s, driven by the scheduler), forming a ring from joined
nodes over a measured RTT mesh kept current (``formation.py``, ``mesh.py``, ``rtt.py``; a
joiner's registration checked for shape, ``registration.py``) and seeded fault injection for
tests (``faults.py``: test support, which nothing in ``src`` imports).
"""

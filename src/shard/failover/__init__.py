"""shard.failover: surviving a node that dies — the scheduler (control plane: registry, death
detection, splicing standbys in, ``scheduler.py``), the control links (``control.py``), a
supervised ring edge with heartbeats and deadlines (``edge.py``), the replay log of what was
sent downstream (``replay.py``), scripted faults on real processes (``script.py``) and
seeded fault injection for tests (``faults.py``: test support, which nothing in ``src``
imports).
"""

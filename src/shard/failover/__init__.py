"""shard.failover: surviving a node that dies — the scheduler (control plane: death detection with
``detector.py``, queueing repairs, ``scheduler.py``, built from ``scheduler_config.py``'s
records; its spot checks are ``shard.audit.checker``'s actor, on channels), the
repairs themselves (splicing standbys in, re-dialling edges: ``splice.py``), the messages it
queues and sends the coordinator's router (``events.py``), the control links (``control.py``)
and what they ask of their node, on channels (``duties.py``), the coordinator generation a
node obeys (``fence.py``), a
supervised ring edge with heartbeats and deadlines (``edge.py``), the replay log of what was
sent downstream (``replay.py``; spot checks and their strikes are ``shard.audit``'s, driven by
the scheduler). Seeded fault injection for its tests is test support: ``shard.testing.faults``.

The scheduler's registry of members and slots and its RTT tracking are ``shard.membership``'s;
forming a ring from joined nodes over a measured RTT mesh is ``shard.formation``'s, which the
scheduler drives (failover imports both; neither imports failover).
"""

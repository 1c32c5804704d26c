"""shard.coordinator: the coordinator's actors — the router that owns sessions and links
(``router.py``), one request's speculative loop (``driver.py``), text in / tokens out
(``service.py``), the client side of that protocol (``client.py``) and per-request checkpoints
(``checkpoint.py``). It may import decode, failover's replay log, observe, trust, transport and
messages; never nodes or cli.
"""

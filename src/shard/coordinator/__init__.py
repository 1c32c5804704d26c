"""shard.coordinator: the coordinator's actors — the ``Coordinator``, which owns sessions and
their routes (``coordinator.py``), one request's speculative loop (``driver.py``), the
records both are built from (``config.py``), the
messages between them (``events.py``), the shared send side of the ring link (``gate.py``),
statistics and the K/D model every request records into (``ledger.py``; the rolling ring
statistics it keeps, ``ringstats.py``, are what the status feed and the monitor show), text in
/ tokens out for wire clients (``service.py``) through the one text adapter that the HTTP API
shares (``text.py``: tokenizing off the event loop, a request's committed tokens read as
text, with stop strings from ``stops.py``), the client side of that protocol
(``client.py``), per-request
checkpoints (``checkpoint.py``) and the link a standby coordinator follows them on
(``follow.py``), receipt gathering (``receipts.py``) and the receipt log that keeps every
request's (``receipt_log.py``), the features a tail
returns (``features.py``) and the boundary that turns any failure on one request's path into
that request's error (``supervise.py``). It may import decode,
failover (its replay log and the scheduler's messages), trust, transport and messages; never
observe, nodes or cli.
"""

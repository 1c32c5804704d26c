"""shard: one large language model, run across many machines as a ring of stages.

Where things live, in the order a token travels::

    cli.py, commands.py     the operator surface: argument parsing, then one handler per command
    node.py                 composition roots: wire one node's actors (the coordinator; the
                            stage and standby in stage_node.py)
    swarm.py, inprocess.py  a whole swarm as local processes / inside one Trio run
    config.py, spec_*.py    typed swarm specs (TOML) and their validation
    service.py, client.py   text requests in, streamed tokens out
    coordinator.py          sessions and what requests share; the scheduler's hooks
      driver.py             one request: prefill, the speculative loop, re-sends after failures
      speculation.py        the speculative loop's pure core: stream, chunks in flight, epochs
      speculation_control.py  choosing K and D: run-length acceptance, stale price, sessions
      draft.py              draft proposers: n-gram lookup, a small model, the oracle
      decoding.py           commit bookkeeping shared with the reference
    messages.py             frozen attrs messages exchanged by every actor
    wire/                   one frame format: msgpack header + raw tensors, zstd, size caps
    transport/              connections over memory channels, WebSockets (plain or sealed),
                            emulated WAN delay, and a delaying TCP relay
    links.py                the Hello/Welcome handshake and the pumps between links and actors
    stage.py                StageExecutor: one block of layers, its KV caches, early cancellation
    stage_node.py           composition roots of a stage and a standby
    edge.py, replay.py      a supervised ring edge: heartbeats, deadlines, replay log, rewire
    scheduler.py, control.py  failover: control links, death detection, splicing standbys in
    checkpoint.py           per-request checkpoints for a restarted coordinator
    verify.py               the target's choice and the lossless acceptance rule
    model/                  the Llama-family model in plain torch, loading, GGUF import,
                            tokenizer and chat template, the bundled SmolLM2
    reference.py            single-process generation: what every distributed mode must equal

Trust, each a small module::

    identity.py, admission.py   node keys; the authority's signed admission tokens
    channel.py, handshake.py,   the mutual handshake, per-direction keys, sealed frames
      sealer.py, trust.py
    manifest*.py, fetch*.py     signed content-addressed manifests; chunk-verified block fetch
    receipts.py, receipt_check.py, device.py
                                signed receipts of who computed what, checkable offline

Observability: ``ringstats.py`` (rolling ring statistics), ``status.py`` (the status feed),
``tui/`` (the Textual monitor). Drafts: ``distill*.py`` (``shard draft distill``).
Test helpers are public API in ``testing.py``; fault injection in ``faults.py``.

The forward pass runs in a worker thread behind a ``CapacityLimiter(1)`` (``offload.py``;
inline under ``inline_compute()`` for virtual-time tests): the only thread boundary.
Everything else is Trio.
"""

__version__ = "0.1.0"

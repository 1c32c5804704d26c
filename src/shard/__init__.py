"""shard: one large language model, run across many machines as a ring of stages.

The packages, in the order a token travels (each ``__init__`` says what it owns and what it
may import; ``tests/test_import_boundaries.py`` enforces the layers)::

    cli/            the operator surface: ``shard`` and one module per command family
    spec/           typed swarm specs (TOML), read and validated in one place
    nodes/          composition roots: one node's actors wired (coordinator, stage, standby),
                    a whole swarm in one Trio run or as local processes
    coordinator/    sessions and their routes; one request's driver (prefill, the speculative
                    loop, re-sends after failures); text in, tokens out; per-request checkpoints
    decode/         pure cores: decoding state, the target's choice and the lossless acceptance
                    rule, the speculative stream, choosing K and D, draft proposers, the
                    single-process reference
    training/       making drafts offline: distillation and the draft head's training
    messages/       frozen attrs messages, split by who talks (ring, control, client, status,
                    fetch), and their tagged union
    wire/           one frame format: msgpack header + raw tensors, zstd, size caps, sealing
    transport/      connections over memory channels, WebSockets (plain or sealed), emulated WAN
                    delay, a delaying TCP relay; the Hello/Welcome handshake (``links.py``)
    stage/          a stage's executor: one block of layers, its KV caches, early cancellation,
                    batching of waiting chunks
    compute/        what every torch-running role shares: where blocking work runs
                    (``offload.py``) and torch tensors to and from the wire (``tensors.py``)
    model/          the model families in plain torch (dense and mixture-of-experts), weights
                    kept quantized, loading, tokenizer and chat template (imports nothing of
                    the network)
    convert/        beside the runtime: GGUF checkpoints converted to safetensors, and the
                    bundled SmolLM2 and Gemma 3 found and converted once into the cache
    placement/      pure planning: which nodes form the ring, in which order, holding which
                    layers, the coordinator where; the sticky re-plan after a failure
    failover/       recovery: the scheduler (death detection, splicing standbys in), control
                    links, supervised edges with heartbeats, the replay log
    formation/      forming a ring from nodes that joined, over an RTT mesh it measures and
                    keeps current
    membership/     what formation and recovery share: the registry of members and ring slots,
                    RTT tracking and measurement
    audit/          spot checks: sampled chunks recomputed on another node, strikes, evidence
    trust/          node keys, admission tokens, the mutual handshake and sealed frames, signed
                    receipts and their offline check, device identity
    weights/        signed content-addressed manifests, chunk-verified block fetch, seeders
    api/            the OpenAI-compatible HTTP API and the chat page, served by the coordinator
    observe/        the status feed, device probes, the Textual monitor (``tui/``)
    testing/        test support (tiny checkpoints, cheating stages, NAT helpers)

Beside them: ``errors.py`` (errors shared by layers that must not import each other),
``logs.py`` (the ``NOTE`` level: good news an operator sees without ``--verbose``),
``strict_json.py`` (JSON from outside, parsed so it cannot crash or fool its reader: no key
twice, no deep nesting) and ``__main__.py`` (``python -m shard``).

Test helpers (seeded fault injection, ``testing/faults.py``, included) are public API, all in
``testing/``; nothing else in ``src`` imports them. Every blocking call leaves the
event loop through one helper, ``compute/offload.py``'s ``run_sync`` (a worker thread; inline
under ``inline_compute()`` for virtual-time tests): forward passes, drafting and audits each
behind their own ``CapacityLimiter(1)``, tokenizing behind another, so text never queues
behind a forward pass; large frames' sealing and decoding, evidence files and a seeder's hash
check without one. The one other thread is ``nodes/lifeline.py``'s watcher, which ends a node
whose launcher died. Everything else is Trio.
"""

__version__ = "0.1.0"

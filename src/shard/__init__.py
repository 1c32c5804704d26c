"""shard: one large language model, run across many machines as a ring of stages.

Where things live, in the order a token travels::

    cli.py / node.py       the operator surface and the composition root that wires actors
    config.py              typed swarm specs (TOML) and their validation
    coordinator.py         tokenizer, sessions, the decoding loop; drives the ring
    messages.py            frozen attrs messages exchanged by every actor
    wire/                  one frame format: msgpack header + raw tensors, zstd, size caps
    transport/             connections over memory channels, WebSockets, emulated WAN delay
    stage.py               StageExecutor: one contiguous block of layers and its KV caches
    model/                 the Llama-family model in plain torch, loading, GGUF import,
                           tokenizer, sampling, single-process reference generation
    testing.py             public helpers for tests: tiny random checkpoints, in-process swarms

The forward pass runs in a worker thread behind a ``CapacityLimiter(1)``: the only thread
boundary. Everything else is Trio.
"""

__version__ = "0.1.0"

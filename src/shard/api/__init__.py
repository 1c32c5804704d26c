"""shard.api: the coordinator's OpenAI-compatible HTTP API and its chat page.

An ASGI app of our own (``app.py``) served by hypercorn's Trio worker (``server.py``), inside
the coordinator's process: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (plain JSON or server-sent events), ``GET /health``,
``GET /metrics`` (Prometheus text) and the chat page at ``/`` (``page.html``, one static file).
The pure parts have modules of their own, each with plain tests: request validation into typed
records (``schema.py``), the OpenAI error shape (``errors.py``), the OpenAI response shapes
(``responses.py``), hashed bearer keys (``keys.py``), the metrics text (``metrics.py``) and
the ``X-Shard-Resume`` header of a stream resumed on a standby coordinator (``resume.py``);
``reply.py`` is the ASGI plumbing of one response; ``runner.py`` prepares one validated request
for the coordinator's text adapter (``shard.coordinator.text``, which the wire clients share;
stop strings are ``shard.coordinator.stops``), whose stream the app reads, and maps how it
ended. It may import coordinator, decode, model (the tokenizer), spec, observe and messages;
never nodes or cli. Documented in docs/api.md.
"""

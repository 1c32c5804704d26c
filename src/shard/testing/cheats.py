"""Cheating stages for tests of spot checks (re-exported by ``shard.testing``; never imported
by production code — ``tests/test_import_boundaries.py`` enforces it).

A ``CheatingBlock`` wraps a real ``StageModel`` and lies in one of the ways a dishonest stage
could, while still signing perfectly valid receipts (it computes, and writes its KV, honestly
underneath, so its lies are only in what it sends on):

==================  ==========================================================================
``skip_layer``      the block's last layer is skipped
``noise``           small Gaussian noise (``noise`` x the output's std) is added
``identity``        the input is sent on unchanged (the block did nothing)
``stale``           the previous chunk's output is replayed (when the shapes allow)
``one_in_n``        lies (``lie``, default noise) on one chunk in ``every``, honest otherwise
``when_unaudited``  lies (``lie``) only when no audit was seen in the last ``window`` chunks
``wrong_token``     the tail only: its logits are shifted one token along the vocabulary, so
                    it chooses the token after the right one (``lie`` may be it too)
==================  ==========================================================================

At the tail the lies apply to the logits its head returns (``skip_layer`` runs the head on
the block without its last layer; ``identity`` has no tail form); a session's features
(``feature_rows``) stay honest. A batched forward (``shard.stage.batch`` packs several chunks
into one ``forward_packed``) goes around the block's ``__call__``: inside ``batched_lies()``
(a context manager that wraps ``shard.stage.batch.forward_packed`` for this process) a
``CheatingBlock`` tells the same lies on every chunk of a batch too — ``stale`` excepted (it
is honest in a batch), and ``one_in_n``/``when_unaudited`` decide once per batch. Without it
a cheater lies only on the chunks it runs alone. ``OverstatingTail`` lies in
the verdict itself: it reports one more accepted draft than held, with the right tokens — the
output is unchanged, the coordinator's speculation statistics are not.

``when_unaudited`` models a stage that somehow learns when it was audited: the test calls
``audited()`` for each chosen chunk. Audits are chosen by a seed the stage never sees, so
honesty right after an audit buys it nothing about the next chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, cast

import attrs
import torch
import trio

from shard.audit.sampler import AuditSampler
from shard.messages import Hello, Message, Verdict
from shard.messages.audit import AuditRequest
from shard.model.kvcache import KVCache
from shard.model.llama import Block, StageModel, TailOut
from shard.model.masks import causal_mask
from shard.model.packed import Segment
from shard.transport import Connection, Network
from shard.transport.base import Handler, NetworkBase

__all__ = [
    "CHEATS",
    "AuditTap",
    "CheatingBlock",
    "OverstatingTail",
    "batched_lies",
    "cheating",
]

CHEATS: Final = (
    "skip_layer",
    "noise",
    "identity",
    "stale",
    "one_in_n",
    "when_unaudited",
    "wrong_token",
)
_BASE_LIES: Final = ("skip_layer", "noise", "identity", "stale", "wrong_token")


class CheatingBlock:
    """A real block that lies (see the module docstring); every attribute but the call is the
    wrapped block's, so a ``StageExecutor`` runs it as it runs a ``StageModel``."""

    def __init__(
        self,
        inner: StageModel,
        kind: str,
        *,
        lie: str = "noise",
        every: int = 4,
        window: int = 8,
        noise: float = 1e-3,
        seed: int = 0,
    ) -> None:
        if kind not in CHEATS or lie not in _BASE_LIES:
            raise ValueError(f"unknown cheat {kind!r}/{lie!r}; kinds: {', '.join(CHEATS)}")
        if kind in ("identity", "skip_layer") and inner.is_first:
            raise ValueError(f"{kind}: a first stage's input is token ids; cheat a later one")
        lie_kind = kind if kind in _BASE_LIES else lie
        if (lie_kind == "wrong_token") != inner.is_last and lie_kind in ("wrong_token", "identity"):
            raise ValueError(f"{lie_kind}: wrong_token is the tail's lie, identity is not")
        self._inner = inner
        self.kind = kind
        self._lie_kind = kind if kind in _BASE_LIES else lie
        self._every = every
        self._window = window
        self._noise = noise
        self._gen = torch.Generator().manual_seed(seed)
        self._last: torch.Tensor | None = None
        self._since_audit = window  # nothing audited yet
        self.calls = 0
        self.lies = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def audited(self, *_: object) -> None:
        """An audit was seen (``when_unaudited`` stays honest for ``window`` chunks)."""
        self._since_audit = 0

    def _lies_now(self) -> bool:
        if self.kind == "one_in_n":
            return self.calls % self._every == 0
        if self.kind == "when_unaudited":
            return self._since_audit >= self._window
        return True

    def __call__(
        self,
        x: torch.Tensor,
        start: int,
        cache: KVCache,
        *,
        head_rows: int | None = None,
        feature_rows: int | None = None,
    ) -> torch.Tensor | TailOut:
        if feature_rows is not None:
            out = self._inner(x, start, cache, head_rows=head_rows, feature_rows=feature_rows)
            return TailOut(self._answer(x, start, cache, out.logits, head_rows), out.features)
        return self._answer(
            x, start, cache, self._inner(x, start, cache, head_rows=head_rows), head_rows
        )

    def _answer(
        self,
        x: torch.Tensor,
        start: int,
        cache: KVCache,
        honest: torch.Tensor,
        head_rows: int | None,
    ) -> torch.Tensor:
        """What it sends on for a chunk whose honest output is ``honest``."""
        self.calls += 1
        lying = self._lies_now()
        self._since_audit += 1
        out = self._lie(x, start, cache, honest, head_rows) if lying else None
        self._last = honest
        if out is None:
            return honest
        self.lies += 1
        return out

    def _lie(
        self,
        x: torch.Tensor,
        start: int,
        cache: KVCache,
        honest: torch.Tensor,
        head_rows: int | None,
    ) -> torch.Tensor | None:
        kind = self._lie_kind
        if kind == "wrong_token":
            return honest.roll(1, dims=-1)  # [B, R, V]: each row's argmax moves one token on
        if kind == "identity":
            return x.clone()
        if kind == "stale":
            last = self._last
            return last.clone() if last is not None and last.shape == honest.shape else None
        if kind == "noise":
            scale = float(honest.float().std()) * self._noise
            noise = torch.randn(honest.shape, generator=self._gen) * scale
            return honest + noise.to(honest.dtype)
        return self._skip_last_layer(x, start, cache, head_rows)

    def packed(
        self, honest_forward: Callable[..., Any], x: torch.Tensor, segments: Sequence[Segment],
        **kw: Any,
    ) -> Any:  # fmt: skip
        """A batched forward (``forward_packed``'s arguments) with this block's lie: the
        honest forward runs first (its KV is written honestly, as on the lone path), then the
        lie replaces what it returns."""
        out = honest_forward(self._inner, x, segments, **kw)
        self.calls += 1
        lying = self._lies_now() and self._lie_kind != "stale"
        self._since_audit += 1
        if not lying:
            return out
        self.lies += 1
        if self._lie_kind == "skip_layer":
            lie = honest_forward(_WithoutLastLayer(self._inner), x, segments, **kw)
        elif self._lie_kind == "identity":
            return x.clone()  # [1, T, D]: the input sent on
        else:
            logits = out.logits if isinstance(out, TailOut) else out
            lie = self._lie(x, 0, segments[0].cache, logits, None)
        if isinstance(out, TailOut):
            return TailOut(lie.logits if isinstance(lie, TailOut) else lie, out.features)
        return lie

    def _skip_last_layer(
        self, x: torch.Tensor, start: int, cache: KVCache, head_rows: int | None
    ) -> torch.Tensor:
        """The block's forward with its last layer left out (not a first block); at the tail
        its head runs on the result."""
        m = self._inner
        s = int(x.shape[1])
        cos, sin = m.rope_cos[start : start + s], m.rope_sin[start : start + s]  # [S, Dh/2]
        rope = (cos.to(x.dtype), sin.to(x.dtype))
        mask = causal_mask(start, s, x.device, m.blocks()[0].window)
        h = x
        with torch.inference_mode():
            for j, layer in enumerate(list(m.layers)[:-1]):
                h = layer(h, rope, mask, cache, j, start)
            if m.is_last:
                return m.head(h if head_rows is None else h[:, s - head_rows :])
        return h


class _WithoutLastLayer:
    """A block seen without its last layer (``forward_packed`` reads only attributes)."""

    def __init__(self, inner: StageModel) -> None:
        self._inner = inner
        self.layers = list(inner.layers)[:-1]

    def blocks(self) -> list[Block]:
        return self._inner.blocks()[:-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def batched_lies() -> Iterator[None]:
    """While open, a ``CheatingBlock``'s batched forwards lie too (see the module docstring):
    ``shard.stage.batch.forward_packed`` is wrapped for this process; other blocks run it
    unchanged. Test-only: a process that cheats enters it once (``shard.testing.cheat_node``)."""
    import shard.stage.batch as batch

    names = vars(batch)  # the module's globals: forward_batch looks the name up there
    honest: Callable[..., Any] = names["forward_packed"]

    def forward_packed(model: object, x: torch.Tensor, segments: Any, **kw: Any) -> Any:
        if isinstance(model, CheatingBlock):
            return model.packed(honest, x, segments, **kw)
        return honest(model, x, segments, **kw)

    names["forward_packed"] = forward_packed
    try:
        yield
    finally:
        names["forward_packed"] = honest


def cheating(inner: StageModel, kind: str, **kw: Any) -> StageModel:
    """``CheatingBlock(inner, kind, **kw)`` typed as the block it stands in for."""
    return cast(StageModel, CheatingBlock(inner, kind, **kw))


class OverstatingTail:
    """``run_swarm``'s ``wrap`` hook: the ``tail`` node's verdicts, as they leave it, claim one
    more accepted draft than held (see the module docstring); ``lies`` counts them."""

    def __init__(self, tail: str) -> None:
        self._tail = tail
        self.lies = 0

    def wrap(self, node: str, network: Network) -> Network:
        # every node gets its own wrapper (run_swarm enters each); only the tail's lies
        return _LyingNetwork(network, self if node == self._tail else None)

    def lie(self, msg: Message) -> Message:
        if not isinstance(msg, Verdict):
            return msg
        self.lies += 1
        return attrs.evolve(msg, accepted=msg.accepted + 1)


class _LyingNetwork(NetworkBase):
    def __init__(self, inner: Network, tail: OverstatingTail | None) -> None:
        self._inner, self._tail = inner, tail

    async def dial(self, address: str) -> Connection:
        conn = await self._inner.dial(address)
        return conn if self._tail is None else _LyingConnection(conn, self._tail)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self._inner.serve(address, handler, task_status=task_status)


class _LyingConnection:
    def __init__(self, inner: Connection, tail: OverstatingTail) -> None:
        self._inner, self._tail = inner, tail

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def receive(self) -> Message:
        return await self._inner.receive()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def send(self, msg: Message) -> None:
        await self._inner.send(self._tail.lie(msg))


class AuditTap:
    """Spot checks on one in-process stage, fed from the traffic itself: ``run_swarm``'s
    ``wrap`` hook. What ``upstream`` sends on its ring link into ``accused_address`` goes to
    ``sampler.input`` (the predecessor's view, as its replay log keeps it); what ``accused``
    sends on its ring link goes to ``sampler.output``, and each request the sampler makes is
    sent to ``requests`` (an auditor's inbox). The production coordinator does not yet
    collect these itself (docs/security.md, spot checks: what is wired)."""

    def __init__(
        self,
        sampler: AuditSampler,
        requests: trio.MemorySendChannel[AuditRequest],
        *,
        upstream: str,
        accused: str,
        accused_address: str,
    ) -> None:
        self._sampler = sampler
        self._requests = requests
        self._upstream = upstream
        self._accused = accused
        self._address = accused_address

    def wrap(self, node: str, network: Network) -> Network:
        return _TapNetwork(network, self, node)  # every node: run_swarm enters each wrapper

    async def sent(self, node: str, address: str, msg: Message) -> None:
        if node == self._upstream and address == self._address:
            self._sampler.input(msg)
        elif node == self._accused:
            req = self._sampler.output(msg)
            if req is not None:
                await self._requests.send(req)


class _TapNetwork(NetworkBase):
    def __init__(self, inner: Network, tap: AuditTap, node: str) -> None:
        self._inner, self._tap, self._node = inner, tap, node

    async def dial(self, address: str) -> Connection:
        return _TapConnection(await self._inner.dial(address), self._tap, self._node, address)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self._inner.serve(address, handler, task_status=task_status)


class _TapConnection:
    def __init__(self, inner: Connection, tap: AuditTap, node: str, address: str) -> None:
        self._inner, self._tap, self._node, self._address = inner, tap, node, address
        self._ring = False

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def receive(self) -> Message:
        return await self._inner.receive()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def send(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._ring = msg.link == "ring"
        elif self._ring:
            await self._tap.sent(self._node, self._address, msg)
        await self._inner.send(msg)

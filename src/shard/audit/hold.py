"""HoldBook: ``[audit] mode = "hold"`` — a verdict's tokens reach the client only once an
independent replica confirmed every ring stage's part of it.

In hold mode the hub (``shard.audit.hub``) audits every chunk of every stage (rate 1)
and tells this book which chunk (by session and ``seq``, the number a chunk keeps on every
edge of the ring) it asked an auditor about and how each audit came out. A request's driver
(``shard.coordinator.driver``) calls ``wait(session, seq)`` before it emits the tokens of the
verdict numbered ``seq``, and emits them only when, for every stage of the ring as the hub
last saw it, the audit of that stage's output for ``seq`` passed and no audit of an earlier
chunk of the session is still out: every output that fed the verdict, the KV it attends to
included, was recomputed by another node holding the same block and found true.

A failed audit of the session (a strike), an audit that could not run, or a stage of the
session that cannot be audited (it joined the session mid-way: a spliced-in standby, or its
copies had a gap) ends the wait with ``HoldFailed``; so does ``timeout_s`` without an answer
(no auditor or standby holds a block: the scheduler logs the skipped audit). The request then
ends with the tokens released so far — never one that was not confirmed.

A confirmation is as strong as the audit behind it: bit-exact where replay is, else within
the calibrated sketch threshold or the tail's ``token_margin`` (docs/security.md).

Trio-aware but without I/O: the hub calls the synchronous methods; ``wait`` sleeps on an
event that every change sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from shard.messages import NodeName, SessionId

__all__ = ["HoldBook", "HoldFailed"]


class HoldFailed(Exception):
    """A held verdict cannot be confirmed; the message says which stage and why."""


class HoldBook:
    """See the module docstring."""

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._ring: tuple[NodeName, ...] = ()
        self._pending: dict[tuple[SessionId, NodeName], set[int]] = {}  # asked, not answered
        self._ok: dict[tuple[SessionId, NodeName], set[int]] = {}
        self._failed: dict[SessionId, str] = {}
        self._changed = trio.Event()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def ring(self, nodes: Sequence[NodeName]) -> None:
        """The ring's stages now (a splice changes them)."""
        if tuple(nodes) != self._ring:
            self._ring = tuple(nodes)
            self._touch()

    def asked(self, session: SessionId, node: NodeName, seq: int) -> None:
        self._pending.setdefault((session, node), set()).add(seq)

    def answered(self, session: SessionId, node: NodeName, seq: int, ok: bool, why: str) -> None:
        """An auditor's answer on ``node``'s chunk ``seq`` (``ok`` False: not confirmed)."""
        self._pending.get((session, node), set()).discard(seq)
        if ok:
            self._ok.setdefault((session, node), set()).add(seq)
        else:
            self._failed.setdefault(session, f"{node}'s chunk {seq} was not confirmed: {why}")
        self._touch()

    def unconfirmable(self, session: SessionId, node: NodeName, why: str) -> None:
        """``node``'s chunks of ``session`` cannot be audited (see the module docstring)."""
        self._failed.setdefault(session, f"{node} cannot be audited in this session: {why}")
        self._touch()

    def ended(self, session: SessionId) -> None:
        self._failed.pop(session, None)
        for key in [k for k in (*self._pending, *self._ok) if k[0] == session]:
            self._pending.pop(key, None)
            self._ok.pop(key, None)

    def confirmed(self, session: SessionId, seq: int) -> bool:
        """Whether verdict ``seq`` of ``session`` may be released now. Errors: ``HoldFailed``
        when it never will be."""
        if session in self._failed:
            raise HoldFailed(self._failed[session])
        if not self._ring:
            return False
        for node in self._ring:
            key = (session, node)
            if seq not in self._ok.get(key, ()):
                return False
            if any(s <= seq for s in self._pending.get(key, ())):
                return False
        return True

    async def wait(self, session: SessionId, seq: int) -> None:
        """Return once verdict ``seq`` of ``session`` is confirmed. Errors: ``HoldFailed``
        (not confirmable, or not confirmed within ``timeout_s``)."""
        with trio.move_on_after(self._timeout_s):
            while not self.confirmed(session, seq):
                await self._changed.wait()
            return
        missing = [n for n in self._ring if seq not in self._ok.get((session, n), ())]
        raise HoldFailed(
            f"chunk {seq} of session {session} was not confirmed within {self._timeout_s:g} s "
            f"(no audit answered for {', '.join(missing) or 'an earlier chunk'}; is an auditor "
            "or standby holding every block?)"
        )

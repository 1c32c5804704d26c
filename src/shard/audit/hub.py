"""AuditHub: the scheduler's side of spot checks in a real swarm — per-session seeds, one
sampler per (session, audited stage), fed from the neighbours' copies of ring chunks.

Why this design (the smallest that is correct): the scheduler already knows the ring order,
every node's block, and which standbys hold which block, and has a control link to each. So
every node of a swarm that audits copies the ring chunks it sends and receives up its control
link (``shard.transport.mirror``); the hub takes an audited stage's inputs from what its
predecessor *sent* (the coordinator for stage 0) and its outputs from what its successor
*received* — never from the stage itself. The seed of each session is drawn here when the job
opens (the coordinator derives the job nonce from its commitment, so every receipt signs the
commitment before any chunk is computed) and revealed only to the auditor: a node out of the
ring holding the same block (a dedicated ``role = "auditor"`` one first, else a standby), which
re-runs the chunk and answers with an ``AuditVerdict`` on its own control link. Strikes and
eviction are ``StrikeBook`` and the splice, as for a crash.

Whom it trusts: a verdict only from the node it asked, for that chunk (``answered``);
copies as the neighbours' word (the control link says who sent one, not that it is true: a
lying neighbour can frame a stage; docs/security.md says so).

The tail's output is a ``Verdict`` that goes to the coordinator itself: the coordinator is its
successor, and its copy of each verdict it received ("verdict") is the tail's output; the
tail's inputs are its predecessor's sent copies as for any stage, and the session's sampling
the predecessor's copy of the ``OpenSession`` it sent ("open").

What it does not audit: a stage for a session it joined mid-way (a spliced-in standby: its KV was
rebuilt by replays, in other chunk shapes, so the replay the auditor would run differs); a
session whose copies have a gap (a control link that went down). Costs: each activation
crosses to the coordinator twice more (sent and received copies), and a stage waits for its
copies to be queued.

In ``[audit] mode = "hold"`` every chunk is audited (rate 1) and the hub keeps a
``HoldBook`` (``hold``; ``shard.audit.hold``): which chunk each request asked about and how
its audit came out, so a request's driver releases a verdict's tokens only once every stage's
part of it is confirmed.

Pure and synchronous: ``copied`` returns the requests to send; the scheduler sends them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final, cast

import attrs

from shard.audit.compare import audit_nonce, commit, new_seed
from shard.audit.hold import HoldBook
from shard.audit.sampler import Accused, AuditSampler
from shard.messages import (
    ChunkSeq,
    Epoch,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Verdict,
    Verify,
)
from shard.messages.audit import AuditCopy, AuditRequest, AuditVerdict
from shard.spec.audit import AuditSpec

log = logging.getLogger(__name__)

__all__ = ["AuditHub", "Holder"]

#: Outputs held back waiting for their input's copy (the two arrive on different links).
_EARLY_MAX: Final = 256
#: Audit requests awaiting a verdict, at most.
_ASKED_MAX: Final = 4096
#: (session, audited stage) pairs followed at once: a peer copying chunks of sessions that
#: never end (made up, or whose end was lost) cannot grow the hub past this.
_SESSIONS_MAX: Final = 1024


@attrs.frozen
class Holder:
    """A ring node as the hub sees it: its name, block, and the key its receipts name."""

    node: NodeName
    first: int
    last: int
    key: str = "00" * 32
    device_class: str = "cpu"
    dtype: str = "float32"


@attrs.define
class _Seen:
    sampler: AuditSampler
    complete: bool  # saw the session from its first chunk, with no gap since
    started: bool = False  # its first input is in
    early: list[AuditCopy] = attrs.field(factory=list)  # outputs whose input is not in yet


class AuditHub:
    """See the module docstring. ``coordinator`` names the node that feeds stage 0."""

    def __init__(
        self,
        policy: AuditSpec,
        coordinator: NodeName,
        *,
        batched: bool = False,
        weights_of: Callable[[str], str | None] = lambda node: None,
    ) -> None:
        """``weights_of``: how a ring node holds its block (``[swarm] weights``), which its
        audit requests declare (an auditor replays only on the same kernels)."""
        self._policy = policy
        self._weights_of = weights_of
        self._coordinator = coordinator
        self._batched = batched  # stages batch across sessions: audits compare by sketch
        self._seeds: dict[SessionId, bytes] = {}
        self._seen: dict[tuple[SessionId, NodeName], _Seen] = {}
        self._next: dict[NodeName, int] = {}
        #: requests out, by (auditor, accused, session, chunk), and the chunk's ``seq``: only
        #: these are answered
        self._asked: dict[tuple[NodeName, NodeName, int, int], int] = {}
        self.copies = 0
        #: ``[audit] mode = "hold"``: what each verdict's release waits for (None: not held)
        self.hold = HoldBook(timeout_s=policy.hold_timeout_s) if policy.mode == "hold" else None
        self._rate = 1.0 if self.hold is not None else policy.rate

    def seed(self, session: SessionId) -> bytes:
        """The session's seed, drawn on first use (the router asks when the job opens)."""
        return self._seeds.setdefault(session, new_seed())

    def asked(self, auditor: NodeName, req: AuditRequest) -> None:
        """``req`` is going to ``auditor``: its verdict will be taken (the oldest of too many
        unanswered requests is forgotten)."""
        self._asked[(auditor, req.accused, req.session, req.index)] = req.chunk.seq
        if self.hold is not None:
            self.hold.asked(SessionId(req.session), req.accused, req.chunk.seq)
        while len(self._asked) > _ASKED_MAX:
            del self._asked[next(iter(self._asked))]

    def answered(self, auditor: NodeName, verdict: AuditVerdict) -> bool:
        """Whether ``verdict`` answers a request this hub sent ``auditor`` (once): any other
        is a node accusing on its own word, and is ignored."""
        key = (auditor, verdict.accused, verdict.session, verdict.index)
        if verdict.auditor != auditor or key not in self._asked:
            return False
        seq = self._asked.pop(key)
        if self.hold is not None:
            ok = (
                verdict.ok and verdict.method != "error"
            )  # an audit that did not run confirms nothing
            why = (
                verdict.detail
                if verdict.method != "error"
                else f"the audit failed to run: {verdict.detail}"
            )
            self.hold.answered(SessionId(verdict.session), verdict.accused, seq, ok, why)
        return True

    def nonce(self, session: SessionId) -> bytes:
        """The job nonce for ``session``: derived from its seed's commitment
        (``shard.audit.compare.audit_nonce``), so each stage's signed receipt fixes the
        commitment before the stage computes anything."""
        return bytes.fromhex(audit_nonce(commit(self.seed(session))))

    def copied(
        self, sender: NodeName, copy: AuditCopy, ring: Sequence[Holder]
    ) -> list[AuditRequest]:
        """Take ``sender``'s copy; the audit requests it makes due (for ``ring`` as it is)."""
        self.copies += 1
        if self.hold is not None:
            self.hold.ring([h.node for h in ring])
        if self._next.get(sender, copy.n) != copy.n:
            log.warning("audit: copies from %s have a gap; its sessions are not audited", sender)
            for (_, node), seen in self._seen.items():
                seen.complete = seen.complete and node not in _neighbours(sender, ring)
        self._next[sender] = copy.n + 1
        if copy.kind == "end" and sender == self._coordinator:
            self._seeds.pop(SessionId(copy.session), None)
            if self.hold is not None:
                self.hold.ended(SessionId(copy.session))
        names = [self._coordinator, *(h.node for h in ring)]
        if sender not in names:
            return []
        at = names.index(sender)
        if copy.side == "sent" and at + 1 < len(names):
            accused = ring[at]  # names[at + 1]
        elif copy.side == "received" and at >= 2 and copy.kind != "verdict":
            accused = ring[at - 2]  # names[at - 1]
        elif copy.side == "received" and at == 0 and copy.kind == "verdict" and ring:
            accused = ring[-1]  # the tail: the coordinator receives its verdicts
        else:
            return []
        return self._feed(copy, accused)

    def _feed(self, copy: AuditCopy, accused: Holder) -> list[AuditRequest]:
        key = (SessionId(copy.session), accused.node)
        if copy.kind == "end":
            if copy.side == "sent":
                self._seen.pop(key, None)
            return []
        seen = self._seen.get(key)
        if copy.replay or (copy.kind == "open" and copy.side != "sent"):
            return []  # a replay rebuilds a spliced-in node's KV; no receipt or audit counts it
        if seen is None:
            sampler = AuditSampler(
                Accused(
                    accused.node, accused.key, accused.first, accused.last,
                    accused.device_class, accused.dtype, self._batched,
                    self._weights_of(accused.node),
                ),
                seed=self.seed(SessionId(copy.session)),
                rate=self._rate,
            )  # fmt: skip
            seen = self._seen[key] = _Seen(sampler, complete=True)
            if len(self._seen) > _SESSIONS_MAX:  # copies for sessions that never end
                (old_session, old_node), _ = next(iter(self._seen.items()))
                log.warning("audit: tracking too many sessions; session %d of %s dropped",
                            old_session, old_node)  # fmt: skip
                self.ended(old_session)
        if copy.kind == "open":
            seen.sampler.input(OpenSession(SessionId(copy.session), 1, copy.sampling))
            return []
        if copy.side == "sent":
            if not seen.started:
                seen.started, seen.complete = True, seen.complete and copy.start == 0
            seen.sampler.input(_chunk(copy))
            return self._drain(seen) if seen.complete else []
        seen.early.append(copy)
        if len(seen.early) > _EARLY_MAX:  # outputs with no input: the two streams disagree
            log.warning("audit: %s sent chunks it was not given; not audited", accused.node)
            seen.complete, seen.early = False, []
        if not seen.complete and self.hold is not None:
            why = "it joined the session mid-way, or its copies have a gap"
            self.hold.unconfirmable(SessionId(copy.session), accused.node, why)
        return self._drain(seen) if seen.complete else []

    def _drain(self, seen: _Seen) -> list[AuditRequest]:
        """Outputs in the order the successor received them, each once its input is in."""
        out: list[AuditRequest] = []
        while seen.early and seen.sampler.has_input(_chunk(seen.early[0])):
            req = seen.sampler.output(_chunk(seen.early.pop(0)))
            if req is not None:
                out.append(req)
        return out

    def ended(self, session: SessionId) -> None:
        """The session is over: forget its seed and samplers."""
        self._seeds.pop(session, None)
        for key in [k for k in self._seen if k[0] == session]:
            del self._seen[key]


def _neighbours(node: NodeName, ring: Sequence[Holder]) -> set[NodeName]:
    """The ring nodes whose audits ``node``'s copies feed (its predecessor and successor)."""
    names = [h.node for h in ring]
    if node not in names:  # the coordinator: it feeds stage 0 and receives the tail's output
        return set(names[:1]) | set(names[-1:])
    i = names.index(node)
    return set(names[max(i - 1, 0) : i]) | set(names[i + 1 : i + 2])


def _chunk(copy: AuditCopy) -> Prefill | Verify | Verdict:
    """A copied chunk or verdict as the sampler reads it."""
    session, epoch, seq = SessionId(copy.session), cast(Epoch, copy.epoch), cast(ChunkSeq, copy.seq)
    if copy.kind == "verdict":
        return Verdict(session, epoch, seq, copy.start, copy.ids, copy.accepted)
    if copy.verify:
        return Verify(session, epoch, seq, copy.start, copy.ids, copy.hidden, copy.draft, q=copy.q)
    return Prefill(
        session, epoch, seq, copy.start, copy.final, copy.ids, copy.hidden, replay=copy.replay
    )

"""AuditHub: an audited stage's inputs come from its predecessor's sent copies and its outputs
from its successor's received copies, in either arrival order; the tail, a session joined
mid-way and a gap in a node's copies are not audited; only asked-for verdicts are taken."""

from __future__ import annotations

import attrs
import torch

from shard.audit.compare import blob_of, commit
from shard.audit.hub import AuditHub, Holder
from shard.compute.tensors import to_wire
from shard.messages import NodeName
from shard.messages.audit import AuditCopy, AuditVerdict
from shard.spec.audit import AuditSpec

RING = [Holder(NodeName("s0"), 0, 2), Holder(NodeName("s1"), 2, 4), Holder(NodeName("s2"), 4, 6)]
C, S0, S1, S2 = (NodeName(n) for n in ("coord", "s0", "s1", "s2"))


def chunk(side: str, n: int, start: int, value: float, session: int = 1) -> AuditCopy:
    hidden = to_wire(torch.full((1, 2, 4), value))
    return AuditCopy(side, "chunk", n, session, 0, start, start, False, (), hidden)


def test_output_before_input_still_audits_the_middle_stage() -> None:
    """s2's received copy may come before s0's sent one; the request pairs them."""
    hub = AuditHub(AuditSpec(rate=1.0, enabled=True), C)
    assert hub.copied(S2, chunk("received", 0, 0, 2.0), RING) == []
    (req,) = hub.copied(S0, chunk("sent", 0, 0, 1.0), RING)
    assert req.accused == "s1" and (req.first, req.last) == (2, 4)
    assert req.claimed == blob_of(torch.full((1, 2, 4), 2.0))
    assert req.chunk.hidden == blob_of(torch.full((1, 2, 4), 1.0))
    assert req.commitment == commit(bytes.fromhex(req.seed))


def test_tail_midway_sessions_and_gaps_are_not_audited() -> None:
    """Nothing is asked of the tail, of a session first seen mid-way, or after a gap."""
    hub = AuditHub(AuditSpec(rate=1.0, enabled=True), C)
    assert hub.copied(S1, chunk("sent", 0, 0, 1.0), RING) == []  # into the tail
    assert hub.copied(S0, chunk("sent", 0, 4, 1.0, session=2), RING) == []  # mid-way
    assert hub.copied(S2, chunk("received", 0, 4, 2.0, session=2), RING) == []
    assert hub.copied(S0, chunk("sent", 1, 0, 1.0), RING) == []
    assert hub.copied(S2, chunk("received", 5, 0, 2.0), RING) == []  # s2 skipped 1..4


def test_only_verdicts_the_hub_asked_for_are_taken() -> None:
    """A verdict counts once, from the auditor that was asked; anyone else's is refused."""
    hub = AuditHub(AuditSpec(rate=1.0, enabled=True), C)
    hub.copied(S2, chunk("received", 0, 0, 2.0), RING)
    (req,) = hub.copied(S0, chunk("sent", 0, 0, 1.0), RING)
    spare = NodeName("spare")
    verdict = AuditVerdict(req.accused, spare, req.session, req.index, False, "exact", None, "")
    assert not hub.answered(spare, verdict)  # not asked yet
    hub.asked(spare, req)
    assert not hub.answered(S0, attrs.evolve(verdict, auditor=S0))  # s0 was not asked
    assert not hub.answered(S0, verdict)  # claims to be spare, on s0's link
    assert hub.answered(spare, verdict)
    assert not hub.answered(spare, verdict)  # once


def test_sessions_that_never_end_cannot_grow_the_hub() -> None:
    """Copies for ever-new sessions with no end: the hub follows at most its cap of them
    (the oldest dropped, seed and all), and an ended session is forgotten."""
    from shard.audit.hub import _SESSIONS_MAX

    hub = AuditHub(AuditSpec(rate=1.0, enabled=True), C)
    for session in range(1, _SESSIONS_MAX + 200):
        hub.copied(S2, chunk("received", session - 1, 0, 2.0, session=session), RING)
    assert len(hub._seen) == _SESSIONS_MAX
    assert len(hub._seeds) <= _SESSIONS_MAX
    newest = _SESSIONS_MAX + 199
    hub.ended(newest)  # type: ignore[arg-type]
    assert all(key[0] != newest for key in hub._seen)

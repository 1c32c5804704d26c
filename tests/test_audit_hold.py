"""``[audit] mode = "hold"``'s release rule (``shard.audit.hold.HoldBook``), pure: a
verdict is released only once every ring stage's audit of that chunk passed and none of an
earlier chunk is still out; a failed, unrunnable or impossible audit ends the wait with
``HoldFailed``; so does the timeout. Also the spec keys. (The whole path, in a swarm:
``tests/test_audit_wired.py``.)"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shard.audit.hold import HoldBook, HoldFailed
from shard.messages import NodeName, SessionId
from shard.spec.audit import AUDIT_KEYS, AuditSpec, read_audit
from shard.spec.validate import SpecError, Table

S = SessionId(7)
A, B = NodeName("s0"), NodeName("s1")


def _book() -> HoldBook:
    book = HoldBook(timeout_s=5.0)
    book.ring([A, B])
    return book


def test_a_verdict_waits_for_every_stage_and_every_earlier_audit() -> None:
    """Seq 2 is released only when both stages confirmed it and s1's audit of seq 1 is in."""
    book = _book()
    for node in (A, B):
        for seq in (1, 2):
            book.asked(S, node, seq)
    book.answered(S, A, 2, True, "")
    assert not book.confirmed(S, 2)
    book.answered(S, B, 2, True, "")
    assert not book.confirmed(S, 2)  # s1's chunk 1 (and s0's) still out
    book.answered(S, A, 1, True, "")
    book.answered(S, B, 1, True, "")
    assert book.confirmed(S, 2) and book.confirmed(S, 1)
    book.ring([A, B, NodeName("s2")])  # a stage it has no confirmation from
    assert not book.confirmed(S, 2)


@pytest.mark.parametrize("how", ["failed", "unconfirmable"])
def test_a_failed_or_impossible_audit_ends_the_wait(how: str) -> None:
    """A failed audit, or a stage that cannot be audited, raises ``HoldFailed`` naming it;
    other sessions are not affected."""
    book = _book()
    book.asked(S, B, 3)
    if how == "failed":
        book.answered(S, B, 3, False, "min row cosine 1 - 2.6e-04 < the threshold")
    else:
        book.unconfirmable(S, B, "it joined the session mid-way")
    with pytest.raises(HoldFailed, match="s1"):
        book.confirmed(S, 3)
    assert not book.confirmed(SessionId(8), 3)
    book.ended(S)
    assert not book.confirmed(S, 3)


def test_wait_returns_on_confirmation_and_times_out_without_one() -> None:
    """``wait`` wakes when the last confirmation arrives; with none it raises after the
    timeout, naming the stages it had no answer from."""
    book = _book()

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(book.wait, S, 1)
            await trio.testing.wait_all_tasks_blocked()
            book.asked(S, A, 1)
            book.asked(S, B, 1)
            book.answered(S, A, 1, True, "")
            book.answered(S, B, 1, True, "")
        with pytest.raises(HoldFailed, match=r"not confirmed within 5 s .*s0, s1"):
            await book.wait(S, 2)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_mode_and_hold_timeout_are_spec_keys_with_their_bounds() -> None:
    """``mode`` is "sample" (default) or "hold"; ``hold_timeout_s`` a positive number; an
    absent ``cosine_threshold`` is calibrated (None), a given one is kept."""

    def read(**values: object) -> AuditSpec:
        return read_audit(Table.open("t.toml", "audit", values, AUDIT_KEYS))

    assert read().mode == "sample" and read(mode="hold").mode == "hold"
    assert read().cosine_threshold is None and read(cosine_threshold=0.999).cosine_threshold
    assert read(hold_timeout_s=5).hold_timeout_s == 5.0
    with pytest.raises(SpecError, match="mode"):
        read(mode="wait")
    with pytest.raises(SpecError, match="hold_timeout_s"):
        read(hold_timeout_s=0)

"""The coordinator's side of features on the return path: each verdict's features checked
(``shard.coordinator.features``), a hostile tail's malformed ones ending only the request they
came with — with its committed tokens — and proposers that observe them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

from shard.compute.tensors import to_wire
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator, RingError
from shard.coordinator.features import FeatureError, verdict_features
from shard.decode.control import SpeculationConfig
from shard.decode.draft import AdaptiveProposer, Drafter, NGramProposer
from shard.messages import (
    ChunkSeq,
    Epoch,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Tensor,
    Verdict,
    Verify,
)
from shard.spec.limits import Limits

DIM = 8


def _verdict(**kw: Any) -> Verdict:
    base = Verdict(SessionId(1), Epoch(0), ChunkSeq(1), 11, target_ids=(4, 5), accepted=1)
    return attrs.evolve(base, **kw)


def _feats(rows: int, dim: int = DIM, dtype: torch.dtype = torch.float16) -> Tensor:
    return to_wire(torch.ones(rows, dim, dtype=dtype))


def test_verdict_features_are_checked_and_widened() -> None:
    """Good features come back as float32 with their first position; each malformation is a
    ``FeatureError`` naming it."""
    first, rows = verdict_features(
        _verdict(features=_feats(2), features_start=11), window=4, dim=DIM
    ) or (None, None)
    assert first == 11 and rows is not None and rows.dtype == torch.float32
    assert verdict_features(_verdict(), window=0, dim=DIM) is None
    nan = torch.ones(2, DIM, dtype=torch.float16)
    nan[1, 3] = float("nan")
    bad = {
        "did not ask": (_verdict(features=_feats(2), features_start=11), 0, None),
        "no features": (_verdict(), 4, None),
        "float32": (_verdict(features=_feats(2, dtype=torch.float32), features_start=11), 4, None),
        "shape": (_verdict(features=_feats(2, dim=DIM + 1), features_start=11), 4, None),
        "rows": (_verdict(features=_feats(1), features_start=12), 4, None),
        "end at": (_verdict(features=_feats(2), features_start=10), 4, None),
        "NaN": (_verdict(features=to_wire(nan), features_start=11), 4, None),
        "window": (_verdict(features=_feats(5), features_start=6), 4, 11),
    }
    for why, (verdict, window, prompt_len) in bad.items():
        with pytest.raises(FeatureError, match=why):
            verdict_features(verdict, window=window, dim=DIM, prompt_len=prompt_len)
    short = Tensor("float16", (2, DIM), b"\0" * 10)  # a payload that lies about its size
    with pytest.raises(FeatureError, match="payload"):
        verdict_features(_verdict(features=short, features_start=11), window=4, dim=DIM)


class Wants:
    """A proposer that never guesses but asks for features, and records what it observes."""

    name = "wants"
    computes = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, features: int) -> None:
        self.features = features
        self.observed: list[tuple[int, int]] = []

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        self.observed.append((position, int(features.shape[0])))


async def _scripted_tail(
    to_ring: trio.MemoryReceiveChannel[Message],
    from_ring: trio.MemorySendChannel[Message],
    *,
    bad: Verdict | None,
    at: int,
) -> None:
    """Answer every chunk with token 7 and honest features for the sessions that asked;
    session 1's ``at``-th answer is ``bad``'s fields over the honest one."""
    windows: dict[SessionId, int] = {}
    answered: dict[SessionId, int] = {}
    async for msg in to_ring:
        if isinstance(msg, OpenSession):
            windows[msg.session] = msg.features
        if not isinstance(msg, Verify) and not (isinstance(msg, Prefill) and msg.final):
            continue
        n = answered[msg.session] = answered.get(msg.session, 0) + 1
        end = msg.start + len(msg.ids)
        verdict = Verdict(msg.session, msg.epoch, msg.seq, msg.start, target_ids=(7,), accepted=0)
        window = windows.get(msg.session, 0)
        if window:
            rows = min(window, end) if isinstance(msg, Prefill) else 1
            verdict = attrs.evolve(verdict, features=_feats(rows), features_start=end - rows)
        if bad is not None and msg.session == SessionId(1) and n == at:
            verdict = attrs.evolve(
                verdict, features=bad.features, features_start=bad.features_start
            )
        await from_ring.send(verdict)


# The third verdict (a verify chunk at position 6, one row) with these features, and what the
# request's error then says.
NAN = to_wire(torch.full((1, DIM), float("nan")).half())
BAD_FEATURES = {
    "wrong dtype": (_feats(1, dtype=torch.float32), 6, "not one of float16"),
    "wrong width": (_feats(1, dim=DIM * 2), 6, "not \\[rows, 8\\]"),
    "wrong rank": (to_wire(torch.ones(1, 1, DIM).half()), 6, "not \\[rows, 8\\]"),
    "NaN": (NAN, 6, "NaN or infinity"),
    "oversize": (_feats(3), 4, "3 rows of features"),
    "wrong start": (_feats(1), 2, "do not end at 7"),
    "missing": (None, 0, "no features"),
    "unasked": (_feats(1), 6, "did not ask"),
}


@pytest.mark.parametrize("why", BAD_FEATURES)
async def test_a_hostile_tails_features_end_only_that_request(
    why: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A tail sends malformed features (or features nobody asked for) in its third verdict to
    one session: that request ends with RingError naming the problem and keeping its two
    committed tokens; the next session on the same coordinator finishes untouched."""
    to_send, to_recv = trio.open_memory_channel[Message](64)
    from_send, from_recv = trio.open_memory_channel[Message](64)
    unasked = why == "unasked"
    rows, start, match = BAD_FEATURES[why]
    bad = _verdict(features=rows, features_start=start)
    proposers = iter([Wants(0 if unasked else 4), Wants(0 if unasked else 4)])
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=[0],
            limits=Limits(max_len=64, prefill_chunk=4, verdict_timeout_s=30.0),
            feature_dim=DIM,
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
        CoordinatorAides(drafter=Drafter(lambda _prompt: next(proposers))),
    )
    spec = SpeculationConfig(k=2, depth=1)
    results: dict[int, object] = {}

    async def one(i: int, prompt: list[int]) -> None:
        try:
            results[i] = await coordinator.generate(prompt, max_tokens=6, speculation=spec)
        except RingError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        nursery.start_soon(lambda: _scripted_tail(to_recv, from_send, bad=bad, at=3))
        await one(0, [1, 2, 3, 4, 5])  # session 1
        await one(1, [1, 2, 3, 4, 5])  # session 2: the same ring, after the failure
        nursery.cancel_scope.cancel()
    error = results[0]
    assert isinstance(error, RingError), error
    assert "features" in str(error) and error.committed == (7, 7)
    assert re.search(match, str(error)), str(error)
    done = results[1]
    assert not isinstance(done, RingError), done
    assert done.token_ids == (7,) * 6  # type: ignore[attr-defined]
    assert coordinator.statistics().requests_failed == 1


def test_adaptive_proposer_forwards_each_member_its_own_window() -> None:
    """``AdaptiveProposer`` asks for its widest member's window and hands each member that
    reads features the last rows of its own; members that read none are never called."""
    narrow, wide = Wants(2), Wants(5)
    auto = AdaptiveProposer([NGramProposer(), narrow, wide])
    assert auto.features == 5 and NGramProposer().features == 0
    auto.observe(10, torch.zeros(4, DIM))
    assert narrow.observed == [(12, 2)] and wide.observed == [(10, 4)]

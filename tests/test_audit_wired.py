"""The production wiring of spot checks (``[audit] enabled``: the nodes' copies, the
scheduler's hub, the standbys' and auditors' recomputations) in one process, against each
cheat with the liar's forwards batched (the default) and not: the liar is caught within the
expected number of its chunks at the configured rate, evicted, and requests after its
eviction equal the single-process reference; and ``[audit] mode = "hold"``: not one token a
lie produced reaches the client.

In virtual time with compute inline, like ``tests/test_audit_swarm.py``. The cheating block
lies in batched forwards too (``shard.testing.cheats.batched_lies``). Measured vs expected
chunks until the first strike are printed (``-s``)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from audit_fixtures import SwarmStats, swarm_stats
from shard.audit.evidence import evidence_from_json, verify_evidence
from shard.compute.offload import inline_compute
from shard.coordinator.events import RingError
from shard.messages import NodeName
from shard.messages.audit import AuditVerdict
from shard.model.llama import StageModel
from shard.nodes.inprocess import run_swarm
from shard.spec.audit import AuditSpec
from shard.spec.swarm import SwarmSpec
from shard.testing.cheats import batched_lies, cheating
from shard.testing.requests import generate_watching
from shard.transport import MemoryNetwork
from test_audit_swarm import unbatched, with_auditors
from test_failover import MAX_TOKENS, PROMPTS, failover_spec
from test_failover import model_dir as model_dir
from test_failover import references as references

RATE = 0.25
NOISE = 3e-2  # changes greedy tokens (tests/test_audit_batched.py)
HELD = 2  # hold mode audits every chunk of every stage: two prompts keep the test short
LIARS = {"noise": "s1", "skip_layer": "s1", "identity": "s1", "wrong_token": "s2"}


@pytest.fixture(autouse=True)
def lying_batches() -> Iterator[None]:
    with batched_lies():
        yield


@attrs.define
class Round:
    """One round of every prompt at once: per prompt, the tokens its client was sent and
    how the request ended (its output, or the error)."""

    delivered: list[list[int]]
    outputs: list[tuple[int, ...] | None]
    errors: list[str]


async def _round(coordinator: object, spec_prompts: tuple[list[int], ...]) -> Round:
    n = len(spec_prompts)
    r = Round([[] for _ in range(n)], [None] * n, [])

    async def one(i: int) -> None:
        try:
            done = await generate_watching(
                coordinator,  # type: ignore[arg-type]
                spec_prompts[i],
                r.delivered[i].extend,
                max_tokens=MAX_TOKENS,
            )
        except RingError as exc:
            r.errors.append(str(exc))
            return
        r.outputs[i] = done.token_ids

    async with trio.open_nursery() as requests:
        for i in range(n):
            requests.start_soon(one, i)
    return r


def _run(
    spec: SwarmSpec, model_dir: Path, liar: str, kind: str, prompts: int = len(PROMPTS)
) -> tuple[list[Round], SwarmStats, list[AuditVerdict], int]:
    """Two rounds of the first ``prompts`` prompts through an in-process swarm whose ``liar``
    cheats with ``kind`` (none: ``kind`` "none"); the rounds, the scheduler's statistics,
    every verdict it took, and the liar's lies."""
    cheats: list[object] = []

    def wrap_block(name: str, model: StageModel) -> StageModel:
        if name != liar or kind == "none":
            return model
        cheat = cheating(model, kind, noise=NOISE, seed=18)
        cheats.append(cheat)
        return cheat

    rounds: list[Round] = []
    verdicts: list[AuditVerdict] = []

    async def main() -> SwarmStats:
        with inline_compute(), trio.fail_after(900):
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(
                    partial(
                        run_swarm, spec, model_dir=model_dir, network=MemoryNetwork(),
                        wrap_block=wrap_block,
                    )
                )  # fmt: skip
                scheduler, checks = handle.scheduler, handle.checks
                assert scheduler is not None and checks is not None
                audited = checks.audited

                async def record(v: AuditVerdict) -> None:
                    verdicts.append(v)
                    await audited(v)

                checks.audited = record  # type: ignore[method-assign]
                rounds.append(await _round(handle.coordinator, PROMPTS[:prompts]))
                if kind != "none":
                    await _replaced(scheduler, liar)
                rounds.append(await _round(handle.coordinator, PROMPTS[:prompts]))
                stats = swarm_stats(handle)
                nursery.cancel_scope.cancel()
        return stats

    stats = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    lies = sum(c.lies for c in cheats)  # type: ignore[attr-defined]
    return rounds, stats, verdicts, lies


async def _replaced(scheduler: Any, liar: str) -> None:
    """Until the liar's standby has replaced it. The scheduler has no event for a finished
    splice, so this polls its statistics — in virtual time (free, bounded by the caller's
    ``fail_after``). Why wait: a session opened while the splice is under way is served by a
    ring the hub already sees changed (docs/security.md: what does not hold)."""
    while not any(r.lost == liar for r in scheduler.statistics().recoveries):  # noqa: ASYNC110
        await trio.sleep(0.5)


def _first_strikes(verdicts: list[AuditVerdict], liar: str) -> list[int]:
    """Per session of the liar's with a failed audit, its chunks until the first one."""
    first: dict[int, int] = {}
    for v in verdicts:
        if v.accused == liar and not v.ok:
            first[v.session] = min(first.get(v.session, v.index + 1), v.index + 1)
    return sorted(first.values())


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("kind", list(LIARS))
def test_each_cheat_is_caught_evicted_and_then_outputs_are_right(
    model_dir: Path, references: list[tuple[int, ...]], kind: str, batched: bool, tmp_path: Path
) -> None:
    """``[audit] enabled``, rate 0.25, two strikes: the liar is struck in its own sessions
    after about 1/rate of its chunks (printed beside 1/rate: a handful of sessions, so only
    reported here; tests/test_audit_batched.py measures the mean), evicted and replaced by its
    standby; no honest stage is accused; every request of the round after the eviction
    equals the reference; each strike's evidence file (``[audit] evidence_dir``) accuses the
    liar and verifies offline."""
    liar = LIARS[kind]
    policy = AuditSpec(enabled=True, rate=RATE, evidence_dir=str(tmp_path))
    spec = attrs.evolve(failover_spec(model_dir), audit=policy)
    spec = spec if batched else unbatched(spec)
    rounds, stats, verdicts, lies = _run(spec, model_dir, liar, kind)
    recoveries = [(r.kind, r.lost, r.replacement) for r in stats.recoveries]
    first = _first_strikes(verdicts, liar)
    mean = statistics.fmean(first) if first else float("nan")
    print(
        f"{kind} ({'batched' if batched else 'unbatched'}): {lies} lies, audits {stats.audits}; "
        f"chunks until the first strike per session {first} (mean {mean:.1f}, expected "
        f"{1 / RATE:.1f}); recoveries {recoveries}"
    )
    assert lies > 0 and first
    assert ("hot", liar, f"{liar}-standby") in recoveries
    assert stats.audits.evictions == 1
    assert {n for n, _ in stats.audits.by_node} == {NodeName(liar)}
    assert all(v.ok for v in verdicts if v.accused != liar)
    assert not rounds[1].errors
    assert rounds[1].outputs == references  # the round after the eviction
    files = sorted(tmp_path.glob("*.json"))
    assert files  # one per strike (written off the loop: counted, not compared)
    for f in files:
        assert verify_evidence(evidence_from_json(f.read_text())).evidence.accused == liar


@pytest.mark.parametrize(
    "kind", ["none", "noise", "skip_layer", "wrong_token"], ids=lambda k: f"hold-{k}"
)
def test_hold_mode_delivers_no_wrong_token(
    model_dir: Path, references: list[tuple[int, ...]], kind: str
) -> None:
    """``[audit] mode = "hold"`` (batching on, dedicated auditors): every token a client is
    sent is the reference's — a request the liar touched ends with an error after a prefix
    of the reference, or completes right — and the liar is evicted; honest requests (the
    honest swarm, and the round after the eviction) equal the reference."""
    # One strike evicts: in hold mode a request ends at its first unconfirmed chunk, so a
    # liar's sessions may yield a single failed audit between them (with two strikes the
    # eviction, and so this test, then hung on that timing: 1 run in 5 here under load).
    policy = AuditSpec(enabled=True, mode="hold", hold_timeout_s=120.0, strikes=1)
    spec = with_auditors(attrs.evolve(failover_spec(model_dir), audit=policy))
    liar = LIARS.get(kind, "s1")
    rounds, stats, _, lies = _run(spec, model_dir, liar, kind, prompts=HELD)
    wrong = 0
    for r in rounds:
        for i, sent in enumerate(r.delivered):
            ref = references[i]
            wrong += sum(a != b for a, b in zip(sent, ref, strict=False))
            wrong += max(0, len(sent) - len(ref))
            if r.outputs[i] is not None:
                assert r.outputs[i] == ref
    recoveries = [(rc.kind, rc.lost, rc.replacement) for rc in stats.recoveries]
    delivered = [len(d) for d in rounds[0].delivered]
    print(
        f"hold, {kind}: {lies} lies, tokens delivered {delivered} of {MAX_TOKENS} each, wrong "
        f"{wrong}, errors {[e[:100] for e in rounds[0].errors]}, audits {stats.audits}, "
        f"recoveries {recoveries}"
    )
    assert wrong == 0
    assert not rounds[1].errors and rounds[1].outputs == references[:HELD]
    if kind == "none":
        assert not rounds[0].errors and rounds[0].outputs == references[:HELD]
        assert stats.audits.strikes == 0
        return
    assert lies > 0
    assert ("hot", liar, f"{liar}-standby") in recoveries

"""A cheating stage in an in-process swarm is audited, struck twice, evicted and replaced by its
hot standby mid-request; every request's output is identical to the single-process reference.
The tail too: its verdicts are audited from the coordinator's copies of them.

In virtual time with compute inline, like ``tests/test_failover.py`` (whose swarm this reuses):
s1 adds small noise to every chunk it sends on (caught bit-exactly, too small to change a
greedy token), an ``AuditTap`` feeds the sampler from s0's and s1's ring traffic, an
``Auditor`` holding s1's block re-runs the chosen chunks, and its verdicts go to the scheduler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from audit_fixtures import SwarmStats, swarm_stats
from shard.audit.auditor import Auditor, Examiner
from shard.audit.compare import audit_nonce, commit
from shard.audit.evidence import EvidencePins, verify_evidence
from shard.audit.sampler import Accused, AuditSampler
from shard.audit.strikes import StrikeBook
from shard.compute.offload import inline_compute
from shard.coordinator.coordinator import Completion
from shard.messages import NodeName
from shard.messages.audit import AuditRequest, AuditVerdict
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.nodes.inprocess import run_swarm
from shard.spec.audit import AuditSpec
from shard.spec.nodes import Address, StandbySpec
from shard.spec.swarm import SwarmSpec
from shard.testing import AuditTap, OverstatingTail, cheating
from shard.transport import MemoryNetwork, Network
from shard.trust.identity import NodeIdentity
from test_failover import MAX_TOKENS, PROMPTS, failover_spec
from test_failover import model_dir as model_dir
from test_failover import references as references

POLICY = AuditSpec(rate=0.25, strikes=2)
SEED = 18


def test_cheater_is_evicted_and_replaced_with_identical_output(
    model_dir: Path,
    references: list[tuple[int, ...]],
) -> None:
    """Two failed audits evict s1; its standby takes over; outputs equal the reference."""
    spec = unbatched(attrs.evolve(failover_spec(model_dir), audit=POLICY))
    auditor_key = NodeIdentity.from_seed(b"\x05" * 32)
    s1 = spec.stages[1]
    block = load_stage(model_dir, 2, 4)
    sampler = AuditSampler(
        Accused(NodeName("s1"), "00" * 32, 2, 4, "cpu", "float32"),
        seed=random.Random(SEED).randbytes(32),
        rate=POLICY.rate,
    )
    results: list[Completion] = []
    verdicts: list[AuditVerdict] = []

    def wrap_block(name: str, model: StageModel) -> StageModel:
        return cheating(model, "noise", noise=1e-4, seed=SEED) if name == "s1" else model

    async def main() -> None:
        req_send, req_recv = trio.open_memory_channel[AuditRequest](
            64
        )  # audits queue, sends don't wait
        ver_send, ver_recv = trio.open_memory_channel[AuditVerdict](0)
        tap = AuditTap(
            sampler, req_send, upstream="s0", accused="s1", accused_address=str(s1.listen)
        )
        examiner = Examiner(block, NodeName("auditor"), auditor_key, "cpu", POLICY)
        auditor = Auditor(examiner, req_recv, ver_send)
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(
                    partial(
                        run_swarm,
                        spec,
                        model_dir=model_dir,
                        network=MemoryNetwork(),
                        wrap=tap.wrap,
                        wrap_block=wrap_block,
                    )
                )
                checks = handle.checks
                assert checks is not None
                await nursery.start(auditor.run)

                async def judge() -> None:
                    async for v in ver_recv:
                        verdicts.append(v)
                        await checks.audited(v)

                nursery.start_soon(judge)

                async def one(i: int) -> None:
                    results.append(
                        await handle.coordinator.generate(PROMPTS[i], max_tokens=MAX_TOKENS)
                    )

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                stats = swarm_stats(handle)
                nursery.cancel_scope.cancel()
        recoveries = [(r.kind, r.lost, r.replacement) for r in stats.recoveries]
        print(f"seed {SEED}: audits {stats.audits}, recoveries {recoveries}")
        assert ("hot", "s1", "s1-standby") in recoveries
        assert stats.audits.evictions == 1 and stats.audits.strikes >= POLICY.strikes

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(r.token_ids for r in results) == sorted(references)
    failed = [v for v in verdicts if not v.ok]
    assert failed and all(v.accused == "s1" and v.method == "exact" for v in failed)
    assert all(v.ok for v in verdicts if v.accused != "s1")
    evidence = failed[0].evidence
    assert evidence is not None
    checked = verify_evidence(evidence, EvidencePins(auditor=auditor_key.public))
    assert not checked.bound  # evicted mid-request: no receipt, the auditor's word


def test_strike_book_evicts_once_at_the_limit_and_ignores_unrunnable_audits() -> None:
    """Strikes count failed audits only; the node is evicted once, at ``strikes``."""
    book = StrikeBook(2)

    def verdict(ok: bool, method: str = "exact") -> AuditVerdict:
        return AuditVerdict(NodeName("s1"), NodeName("a"), 1, 0, ok, method, None, "")

    assert not book.record(verdict(True))
    assert not book.record(verdict(True, "error"))
    assert not book.record(verdict(False))
    assert book.record(verdict(False))
    assert not book.record(verdict(False))  # already evicted
    stats = book.statistics()
    assert (stats.audits, stats.strikes, stats.evictions) == (5, 3, 1)


def unbatched(spec: SwarmSpec) -> SwarmSpec:
    """``spec`` with batching off: audits compare bit-exactly (a batched forward matches a lone
    recomputation only to rounding, so with batching they compare by sketch)."""
    return attrs.evolve(spec, limits=attrs.evolve(spec.limits, max_batch_rows=1))


def with_auditors(spec: SwarmSpec) -> SwarmSpec:
    """``spec`` plus a dedicated auditor (``[[standby]] role = "auditor"``) for each stage's
    block (the tail's too: it is audited)."""
    auditors = tuple(
        StandbySpec(f"auditor{i}", Address.parse(f"127.0.0.1:{9031 + i}"), f"s{i}", "auditor")
        for i in range(3)
    )
    return attrs.evolve(spec, standbys=(*spec.standbys, *auditors))


async def serve_prompts(
    spec: SwarmSpec,
    model_dir: Path,
    results: list[Completion],
    *,
    wrap_block: Callable[[str, StageModel], StageModel],
    wrap: Callable[[str, Network], Network] | None = None,
) -> SwarmStats:
    """Every prompt at once through an in-process swarm of ``spec`` (completions appended to
    ``results``); its recoveries and strikes after."""
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            partial(
                run_swarm,
                spec,
                model_dir=model_dir,
                network=MemoryNetwork(),
                wrap=wrap,
                wrap_block=wrap_block,
            )
        )

        async def one(i: int) -> None:
            results.append(await handle.coordinator.generate(PROMPTS[i], max_tokens=MAX_TOKENS))

        async with trio.open_nursery() as requests:
            for i in range(len(PROMPTS)):
                requests.start_soon(one, i)
        stats = swarm_stats(handle)
        nursery.cancel_scope.cancel()
    return stats


@pytest.mark.parametrize(
    ("batched", "lie", "auditors"),
    [(False, "noise", False), (True, "skip_layer", False), (False, "noise", True)],
    ids=["unbatched-exact-noise", "batched-sketch-skip", "unbatched-exact-noise-auditors"],
)
def test_wired_audits_evict_the_cheater_and_never_accuse_the_honest(
    model_dir: Path,
    references: list[tuple[int, ...]],
    batched: bool,
    lie: str,
    auditors: bool,
) -> None:
    """``[audit] enabled``, no test tap: the nodes' copies, the scheduler's hub and the
    standbys' auditors (the production wiring, in one process) evict s1; s0 and the standby
    that replaces s1 pass every audit. Unbatched, audits are bit-exact and catch noise too
    small to change a token: every output equals the reference. Batched (the default), they
    compare by sketch and must not accuse an honest stage whose rows were batched; a skipped
    layer is caught (its tokens before the eviction may differ: not compared). The cheating
    wrapper lies on the chunks it runs alone; a batched forward goes through its real block.
    With ``auditors``, dedicated auditors hold s0's and s1's blocks: they answer every audit
    (asked before the standbys holding the same blocks), and the splice still takes s1's
    standby, never an auditor."""
    policy = AuditSpec(enabled=True, rate=1.0, strikes=2)
    spec = attrs.evolve(failover_spec(model_dir), audit=policy)
    if not batched:
        spec = unbatched(spec)
    if auditors:
        spec = with_auditors(spec)
    results: list[Completion] = []

    def wrap_block(name: str, model: StageModel) -> StageModel:
        if name != "s1":
            return model
        if lie == "noise":
            return cheating(model, "noise", noise=1e-4, seed=SEED)
        return cheating(model, "skip_layer")  # lies on what it runs alone (see below)

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            stats = await serve_prompts(spec, model_dir, results, wrap_block=wrap_block)
        recoveries = [(r.kind, r.lost, r.replacement) for r in stats.recoveries]
        print(f"audits {stats.audits}, recoveries {recoveries}")
        assert ("hot", "s1", "s1-standby") in recoveries
        assert stats.audits.evictions == 1
        assert dict(stats.audits.by_node) == {NodeName("s1"): stats.audits.strikes}
        assert stats.audits.audits > stats.audits.strikes  # s0's passed audits counted too
        answered_by = {node for node, _ in stats.audits.by_auditor}
        if auditors:  # every audit by a dedicated auditor; s0's and s1's both (the tail's
            # few: s1's eviction leaves a gap in its copies, and s2's sessions go unaudited)
            dedicated = {NodeName(f"auditor{i}") for i in range(3)}
            assert {NodeName("auditor0"), NodeName("auditor1")} <= answered_by <= dedicated
            assert ("auditor0", "auditor", True) in stats.members
        else:
            assert answered_by <= {NodeName(f"s{i}-standby") for i in range(3)}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(results) == len(PROMPTS)
    if not batched:
        assert sorted(r.token_ids for r in results) == sorted(references)


def test_an_auditing_coordinator_derives_the_job_nonce_from_the_seed_commitment(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``[audit] enabled`` the run receipt and every stage receipt sign
    ``audit_nonce(commit(seed))``: the seed was fixed before any chunk was computed."""
    seed = random.Random(SEED).randbytes(32)
    monkeypatch.setattr("shard.audit.hub.new_seed", lambda: seed)
    spec = attrs.evolve(
        failover_spec(model_dir), audit=AuditSpec(enabled=True, rate=0.5, strikes=2)
    )
    done: list[Completion] = []

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(
                    partial(run_swarm, spec, model_dir=model_dir, network=MemoryNetwork())
                )
                done.append(
                    await handle.coordinator.generate(
                        PROMPTS[0], max_tokens=MAX_TOKENS, receipt=True
                    )
                )
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    receipt = done[0].receipt
    assert receipt is not None
    assert receipt.nonce == audit_nonce(commit(seed))
    assert receipt.stages and all(s.nonce == receipt.nonce for s in receipt.stages)


@pytest.mark.parametrize(
    ("lie", "batched"),
    [("none", False), ("none", True), ("overstate", False), ("wrong_token", False)],
    ids=["honest", "honest-batched", "overstate", "wrong_token"],
)
def test_the_tail_is_audited_and_a_lying_one_is_replaced_mid_request(
    model_dir: Path, references: list[tuple[int, ...]], lie: str, batched: bool
) -> None:
    """The tail's verdicts are audited from the coordinator's copies of them (it is the tail's
    successor) and the predecessor's copies of its inputs. Speculating (ngram drafts, two
    chunks in flight). An honest tail passes every audit, batched (margin) or not (bit-exact).
    A lying one fails: s2 is evicted after two strikes and its standby takes over
    mid-request, while s0 and s1 are never accused. ``overstate`` claims one more accepted
    draft than held, with the right tokens: every output equals the reference.
    ``wrong_token`` chooses the wrong token: caught the same way (the tokens it chose before
    its eviction are in the outputs: not compared)."""
    policy = AuditSpec(enabled=True, rate=1.0, strikes=2)
    spec = attrs.evolve(failover_spec(model_dir, speculate=True), audit=policy)
    spec = spec if batched else unbatched(spec)
    overstating = OverstatingTail("s2")
    results: list[Completion] = []

    def wrap_block(name: str, model: StageModel) -> StageModel:
        return cheating(model, "wrong_token") if lie == "wrong_token" and name == "s2" else model

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            wrap = overstating.wrap if lie == "overstate" else None
            stats = await serve_prompts(spec, model_dir, results, wrap_block=wrap_block, wrap=wrap)
        recoveries = [(r.kind, r.lost, r.replacement) for r in stats.recoveries]
        print(f"{lie}: audits {stats.audits}, recoveries {recoveries}, lies {overstating.lies}")
        tail_audits = dict(stats.audits.by_auditor).get(NodeName("s2-standby"), 0)
        if lie == "none":
            assert stats.audits.strikes == 0 and not recoveries
            assert tail_audits >= 20  # every verdict of the three requests
            return
        assert ("hot", "s2", "s2-standby") in recoveries
        assert stats.audits.evictions == 1
        assert dict(stats.audits.by_node) == {NodeName("s2"): stats.audits.strikes}
        assert stats.audits.strikes >= policy.strikes and tail_audits >= policy.strikes

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(results) == len(PROMPTS)
    if lie == "overstate":
        assert overstating.lies > 0
    if lie != "wrong_token":
        assert sorted(r.token_ids for r in results) == sorted(references)

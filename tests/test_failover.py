"""Deterministic fault injection on the in-process swarm, in virtual time.

Every scenario runs a seeded ``FaultPlan`` (one fault: its kind, the node, the frame it hits,
its duration) against a 3-stage ring with a hot standby per stage and three concurrent
requests, under ``MockClock(autojump_threshold=0)`` with compute inline, so seconds of
heartbeats and timeouts pass in milliseconds. Each request must complete with output
token-identical to the single-process reference — or, where recovery is impossible by
design (no standby), end with ``RingError`` carrying a prefix of it: no token lost, none
invented. A failing scenario's message starts with its plan (seed, kind, node, frame).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from shard.compute.offload import inline_compute
from shard.coordinator.checkpoint import CheckpointStore
from shard.coordinator.coordinator import Completion, RingError
from shard.coordinator.service import complete
from shard.decode.reference import generate_reference
from shard.failover.scheduler import Recovery
from shard.messages import Fault, GenerateDone, GenerateRequest, Heartbeat, Hello, Message, NodeName
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.coordinator import (
    CoordinatorHandle,
    DrafterMaker,
    run_coordinator,
    run_standby,
)
from shard.nodes.inprocess import run_swarm
from shard.spec.failover import FailoverSpec
from shard.spec.swarm import SwarmSpec
from shard.testing import generate_watching, make_tiny_checkpoint
from shard.testing.faults import FaultInjector, FaultPlan, Injection
from shard.transport import ConnectionClosed, MemoryNetwork, Network
from shard.transport.links import dial_peer

PROMPTS = ([5, 17, 99, 3, 8, 8, 41, 5, 17], [200, 31, 7, 7, 7, 64, 12, 1, 150, 9, 44], [42, 42])
MAX_TOKENS = 20
SENDERS = ("coord", "s0", "s1", "s2")  # each sends on one ring edge: coord->s0 ... s2->coord
PREFILL = (1, 5)  # frames a sender sends while the prompts are still being prefilled
DECODE = (14, 40)  # frames well into decoding


def failover_spec(
    model_dir: Path,
    *,
    standbys: bool = True,
    spare: bool = False,
    late: bool = False,
    speculate: bool = False,
    join_deadline_s: float = 5,
    dead_after_s: float = 1.0,
    latency_ms: float | None = None,
) -> SwarmSpec:
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 96, "prefill_chunk": 4, "max_sessions": 8, "retry_after_s": 3.0},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": [2 * i, 2 * i + 2]}
            for i in range(3)
        ],
        # LAN timings (the defaults are for a WAN): a stall of 2-4 s outlasts dead_after_s
        "failover": {"join_deadline_s": join_deadline_s, "dead_after_s": dead_after_s},
    }
    if standbys:
        data["standby"] = [
            {"name": f"s{i}-standby", "listen": f"127.0.0.1:{9011 + i}", "layers_of": f"s{i}"}
            for i in range(3)
        ]
    if spare:  # no block loaded: the cold path loads one when it is needed
        data["standby"] = [{"name": "spare", "listen": "127.0.0.1:9021"}]
    if late:  # a standby for s1 that the test starts only after the fault
        data["standby"] = [{"name": "late", "listen": "127.0.0.1:9022", "layers_of": "s1"}]
    if speculate:
        data["speculation"] = {"draft": "ngram", "k": 3, "depth": 2}
    if latency_ms is not None:  # one way, every edge (emulated in process)
        data["links"] = {"latency_ms": latency_ms}
    return SwarmSpec.from_dict(data, source="failover-test.toml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=11, n_layers=6)


@pytest.fixture(scope="module")
def references(model_dir: Path) -> list[tuple[int, ...]]:
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    return [
        generate_reference(
            model,
            list(p),
            eos_ids=config.eos_token_ids,
            max_tokens=MAX_TOKENS,
            prefill_chunk=4,
            max_len=96,
        ).token_ids
        for p in PROMPTS
    ]


async def start_swarm(
    nursery: trio.Nursery, spec: SwarmSpec, model_dir: Path, **kw: Any
) -> CoordinatorHandle:
    """``run_swarm`` in ``nursery`` (``kw``: its fault-injection and network options)."""
    handle: CoordinatorHandle = await nursery.start(
        partial(run_swarm, spec, model_dir=model_dir, **kw)
    )
    return handle


@attrs.define
class Outcome:
    results: list[Completion | RingError]
    injector: FaultInjector
    recoveries: tuple[Recovery, ...] = ()
    events: tuple[str, ...] = ()


def run_scenario(
    spec: SwarmSpec,
    model_dir: Path,
    plan: FaultPlan | None,
    *,
    after_fault: Callable[[Network], Awaitable[None]] | None = None,
    drafts: DrafterMaker | None = None,
) -> Outcome:
    """Run the three requests concurrently on a swarm with ``plan``'s fault, in virtual time.

    ``after_fault(network)`` runs once the fault has fired (e.g. a node joining late);
    ``drafts`` builds the coordinator's proposers instead of the spec (``run_swarm``)."""
    injector = FaultInjector(plan or FaultPlan(0, ()))
    results: list[Completion | RingError | None] = [None] * len(PROMPTS)
    out = Outcome([], injector)

    async def main() -> None:
        network = MemoryNetwork()
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(
                    nursery,
                    spec,
                    model_dir,
                    network=network,
                    wrap=injector.wrap,
                    scopes=injector.scopes,
                    drafts=drafts,
                )
                if after_fault is not None:

                    async def then() -> None:
                        await injector.wait_fired()
                        await after_fault(network)

                    nursery.start_soon(then)

                async def one(i: int) -> None:
                    try:
                        results[i] = await handle.coordinator.generate(
                            PROMPTS[i], max_tokens=MAX_TOKENS
                        )
                    except RingError as exc:
                        results[i] = exc

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                assert handle.scheduler is not None
                out.recoveries = handle.scheduler.statistics().recoveries
                stats = handle.coordinator.statistics()
                out.events = tuple(f"{e.kind}: {e.detail}" for e in stats.events)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    out.results = [r for r in results if r is not None]
    assert len(out.results) == len(PROMPTS)
    return out


SCENARIOS: list[tuple[str, str, tuple[int, int], bool]] = [
    # (kind, node, frames, speculate)
    *[(kind, node, DECODE, False) for kind in ("drop", "duplicate", "reorder") for node in SENDERS],
    ("drop", "s1", PREFILL, False),
    ("reorder", "coord", PREFILL, True),
    ("delay", "s0", DECODE, False),
    ("delay", "s2", PREFILL, True),
    ("corrupt", "coord", DECODE, False),
    ("corrupt", "s1", PREFILL, False),
    ("corrupt", "s2", DECODE, True),
    ("sever", "coord", PREFILL, False),
    ("sever", "s0", DECODE, True),
    ("sever", "s2", DECODE, False),
    *[("kill", node, DECODE, False) for node in ("s0", "s1", "s2")],
    *[("kill", node, PREFILL, False) for node in ("s0", "s1", "s2")],
    ("kill", "s1", DECODE, True),
    ("stall", "s1", DECODE, False),
    ("stall", "s2", PREFILL, False),
    ("duplicate", "s1", DECODE, True),
]


@pytest.mark.parametrize(
    ("index", "kind", "node", "frames", "speculate"),
    [(i, *s) for i, s in enumerate(SCENARIOS)],
    ids=[
        f"{s[0]}-{s[1]}-{'prefill' if s[2] == PREFILL else 'decode'}{'-spec' if s[3] else ''}"
        for s in SCENARIOS
    ],
)
def test_scenario_recovers_with_identical_output(
    model_dir: Path,
    references: list[tuple[int, ...]],
    index: int,
    kind: str,
    node: str,
    frames: tuple[int, int],
    speculate: bool,
) -> None:
    seed = 1000 + index
    seconds = (2.0, 4.0) if kind == "stall" else (0.5, 3.0)
    plan = FaultPlan.random(seed, kind=kind, node=node, frames=frames, seconds=seconds)
    spec = failover_spec(model_dir, speculate=speculate)
    out = run_scenario(spec, model_dir, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == references[i], f"{plan}: request {i} output differs"
    # The fault was handled the way its kind needs, not by luck:
    kinds = [(r.kind, r.lost) for r in out.recoveries]
    if kind in ("kill", "stall"):  # a stall of 2-4 s outlasts dead_after_s = 1 s
        assert ("hot", node) in kinds, f"{plan}: {out.recoveries}"
    elif kind in ("sever", "corrupt"):
        assert ("relink", node) in kinds, f"{plan}: {out.recoveries}"
    elif kind == "drop":  # a lost frame is noticed (a gap, a silence) and re-sent
        assert any(e.startswith("resync") for e in out.events), f"{plan}: {out.events}"
    # (a reorder or duplicate may be harmless: two sessions' frames swapped, a chunk computed
    # twice; the output check above is what they must pass)


def test_no_fault_baseline_matches_reference(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    out = run_scenario(failover_spec(model_dir), model_dir, None)
    assert [r.token_ids for r in out.results if isinstance(r, Completion)] == references
    assert out.recoveries == ()


@pytest.mark.parametrize("node", ["s0", "s1", "s2"])
def test_kill_without_standby_ends_with_committed_tokens(
    model_dir: Path, references: list[tuple[int, ...]], node: str
) -> None:
    """No standby to splice in: after the join deadline every request fails with a clear
    error that carries a prefix of the reference — never a silent stop, no token lost."""
    plan = FaultPlan.random(77, kind="kill", node=node, frames=DECODE)
    spec = failover_spec(model_dir, standbys=False, join_deadline_s=2.0)
    out = run_scenario(spec, model_dir, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    assert [r.kind for r in out.recoveries] == ["failed"], f"{plan}: {out.recoveries}"
    for i, result in enumerate(out.results):
        if isinstance(result, Completion):  # finished before the kill
            assert result.token_ids == references[i], f"{plan}: request {i}"
            continue
        assert "could not be repaired" in str(result), f"{plan}: {result}"
        assert "no standby" in str(result), f"{plan}: {result}"
        committed = result.committed
        assert committed == references[i][: len(committed)], f"{plan}: request {i}"


def test_cold_path_spare_loads_the_lost_block(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """No hot standby, but a spare with no block: it loads s1's layers when assigned."""
    plan = FaultPlan.random(91, kind="kill", node="s1", frames=DECODE)
    out = run_scenario(failover_spec(model_dir, standbys=False, spare=True), model_dir, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    assert [(r.kind, r.lost, r.replacement) for r in out.recoveries] == [("cold", "s1", "spare")]
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == references[i], f"{plan}: request {i} output differs"


def test_standby_joining_within_the_deadline_repairs_the_ring(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """No standby when s1 dies; one starts afterwards, within join_deadline_s: the requests
    wait for it and complete with identical output."""
    plan = FaultPlan.random(92, kind="kill", node="s1", frames=DECODE)
    spec = failover_spec(model_dir, standbys=False, join_deadline_s=20)
    with_late = failover_spec(model_dir, standbys=False, late=True, join_deadline_s=20)

    async def join(network: Network) -> None:
        await run_standby(with_late, "late", network=network, model_dir=model_dir)

    out = run_scenario(spec, model_dir, plan, after_fault=join)
    assert [(r.kind, r.lost, r.replacement) for r in out.recoveries] == [("hot", "s1", "late")]
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == references[i], f"{plan}: request {i} output differs"


def test_restarted_coordinator_resumes_a_checkpointed_request_on_the_warm_ring(
    model_dir: Path, references: list[tuple[int, ...]], tmp_path: Path
) -> None:
    """The coordinator dies mid-request; the stages stay up (warm). A new coordinator on the
    same address finds the request's checkpoint, the tail re-dials it, and resuming gives
    the reference output; the stages drop the dead coordinator's session."""
    base = failover_spec(model_dir, standbys=False)
    spec = attrs.evolve(
        base, failover=attrs.evolve(base.failover, checkpoint_dir=str(tmp_path / "ckpt"))
    )
    prompt, want = PROMPTS[1], references[1]
    resumed: list[Completion] = []
    seen_before: list[int] = []

    async def main() -> None:
        network = MemoryNetwork()
        scopes: dict[str, trio.CancelScope] = {}
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                first = await start_swarm(nursery, spec, model_dir, network=network, scopes=scopes)
                halfway = trio.Event()

                def tokens(ids: tuple[int, ...]) -> None:
                    seen_before.extend(ids)
                    if len(seen_before) >= 8:
                        halfway.set()

                with trio.CancelScope() as request:

                    async def ask() -> None:
                        await generate_watching(
                            first.coordinator,
                            prompt,
                            tokens,
                            max_tokens=MAX_TOKENS,
                            request_id="r1",
                        )

                    nursery.start_soon(ask)
                    await halfway.wait()
                    scopes["coord"].cancel()  # the coordinator process dies ...
                    request.cancel()  # ... and its request with it
                store = CheckpointStore(tmp_path / "ckpt")
                (checkpoint,) = store.pending()
                assert checkpoint.output_ids == want[: len(checkpoint.output_ids)]
                assert len(checkpoint.output_ids) >= 8
                second: CoordinatorHandle = await nursery.start(
                    lambda task_status: run_coordinator(
                        spec, network=network, model_dir=model_dir, task_status=task_status
                    )
                )
                resumed.append(await second.coordinator.resume_request(checkpoint))
                assert store.pending() == []
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(seen_before) < len(want), "the request finished before the coordinator died"
    (done,) = resumed
    assert done.token_ids == want


def test_a_stalled_node_that_wakes_after_its_replacement_is_refused_and_ends(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """s1 freezes for 3 s (past dead_after_s): a standby replaces it and the requests finish.
    When s1 wakes, its control link re-registers; the scheduler refuses a replaced node, and
    s1 ends (NodeReplaced) instead of serving stale sessions — the rest of the swarm runs on."""
    plan = FaultPlan(5, (Injection("stall", "s1", 20, 3.0),))
    spec = failover_spec(model_dir)
    injector = FaultInjector(plan)
    refused: list[str] = []
    outputs: list[tuple[int, ...]] = []

    async def main() -> None:
        refused_send, refused_recv = trio.open_memory_channel[str](4)
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(
                    nursery,
                    spec,
                    model_dir,
                    wrap=injector.wrap,
                    scopes=injector.scopes,
                    refused=refused_send,
                )
                done = await handle.coordinator.generate(PROMPTS[0], max_tokens=MAX_TOKENS)
                outputs.append(done.token_ids)
                refused.append(await refused_recv.receive())  # s1 woke up and was refused
                # the ring still serves, without s1
                again = await handle.coordinator.generate(PROMPTS[0], max_tokens=MAX_TOKENS)
                outputs.append(again.token_ids)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert injector.fired, f"{plan}: the fault never fired"
    assert refused == ["s1"]
    assert outputs == [references[0], references[0]]


def test_control_links_that_never_register_are_closed_and_harm_nothing(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """A peer that opens a control link and stays silent, and one that sends something else
    than Register, are each closed (the second told why); the coordinator keeps serving."""
    spec = failover_spec(model_dir, standbys=False)
    outputs: list[tuple[int, ...]] = []
    told: list[Message] = []

    async def main() -> None:
        network = MemoryNetwork()
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(nursery, spec, model_dir, network=network)
                address = str(spec.coordinator.listen)
                hello = Hello(NodeName("mute"), "stage", spec.name, link="control")
                mute = await dial_peer(network, address, hello, timeout_s=5)
                rude = await dial_peer(
                    network, address, attrs.evolve(hello, node=NodeName("rude")), timeout_s=5
                )
                await rude.send(Heartbeat(NodeName("rude"), 0.0))
                told.append(await rude.receive())
                with pytest.raises(ConnectionClosed):
                    await mute.receive()  # closed after the register timeout, not before
                done = await handle.coordinator.generate(PROMPTS[0], max_tokens=MAX_TOKENS)
                outputs.append(done.token_ids)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (fault,) = told
    assert isinstance(fault, Fault) and "expected Register" in fault.detail
    assert outputs == [references[0]]


def test_a_busy_coordinator_declares_no_healthy_stage_dead(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """The coordinator's event loop stalls for 3 x dead_after_s (as a 900 KB prompt
    tokenized on it once did): when it runs again the watchdog must not take the stages'
    queued heartbeats for silence. No stage is declared dead, nothing is spliced, and a
    900 KB prompt itself is refused by size before it is tokenized."""
    spec = failover_spec(model_dir)
    outputs: list[tuple[int, ...]] = []
    refused: list[GenerateDone] = []

    async def main() -> None:
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(nursery, spec, model_dir)
                outputs.append(
                    (await handle.coordinator.generate(PROMPTS[0], max_tokens=4)).token_ids
                )
                stall = 3 * spec.failover.dead_after_s
                clock.jump(stall)  # every task wakes late at once, as after a stalled loop
                await trio.sleep(4 * spec.failover.heartbeat_s)  # let the watchdog look twice
                request = GenerateRequest(1, "x" * 900_000, 4)
                refused.append(await complete(handle.coordinator, handle.text, request, _drop))
                done = await handle.coordinator.generate(PROMPTS[0], max_tokens=MAX_TOKENS)
                outputs.append(done.token_ids)
                assert handle.scheduler is not None
                stats = handle.scheduler.statistics()
                assert stats.recoveries == (), stats.recoveries
                assert all(alive for _, _, alive in stats.members), stats.members
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert outputs == [references[0][:4], references[0]]
    assert refused[0].finish_reason == "error" and "max_prompt_bytes" in refused[0].error


async def _drop(msg: Message) -> None:
    del msg


def run_requests(
    spec: SwarmSpec,
    model_dir: Path,
    during: Callable[[trio.testing.MockClock], None],
    *,
    injector: FaultInjector | None = None,
) -> Outcome:
    """The three requests on ``spec``'s swarm; ``during(clock)`` runs (synchronously, in the
    coordinator's event loop) once 8 tokens have streamed."""
    injector = injector or FaultInjector(FaultPlan(0, ()))
    out = Outcome([], injector)
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(
                    nursery, spec, model_dir, wrap=injector.wrap, scopes=injector.scopes
                )
                seen: list[int] = []

                def tokens(ids: tuple[int, ...]) -> None:
                    before = len(seen)
                    seen.extend(ids)
                    if before < 8 <= len(seen):
                        during(clock)

                async def one(i: int) -> None:
                    try:
                        done = await generate_watching(
                            handle.coordinator, PROMPTS[i], tokens, max_tokens=MAX_TOKENS
                        )
                        out.results.append(done)
                    except RingError as exc:
                        out.results.append(exc)

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                assert handle.scheduler is not None
                out.recoveries = handle.scheduler.statistics().recoveries
                stats = handle.coordinator.statistics()
                out.events = tuple(f"{e.kind}: {e.detail}" for e in stats.events)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return out


def test_a_busy_coordinator_declares_no_one_dead(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """The coordinator's event loop is not scheduled for 3 s mid-request (a huge prompt
    tokenized on it, a loaded host): every node's heartbeats sit unread meanwhile. That
    silence is the scheduler's, not the nodes': nobody is declared dead or replaced, and the
    requests complete with identical output."""

    def busy(clock: trio.testing.MockClock) -> None:
        clock.jump(3.0)  # time passes and nothing else runs: a blocked event loop

    out = run_requests(failover_spec(model_dir), model_dir, busy)
    assert sorted(r.token_ids for r in out.results if isinstance(r, Completion)) == sorted(
        references
    ), out.events
    assert [r for r in out.recoveries if r.kind != "relink"] == [], out.recoveries
    assert not any("dead" in e or "replaced" in e for e in out.events), out.events


def test_a_stalled_stage_with_no_standby_rejoins_its_slot(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """No standby; s1 freezes for 5 s (past dead_after_s, with the default WAN timings too):
    it is declared dead, nobody takes its slot, and when it wakes it is taken back into it
    (re-synced from s0's replay log) — not refused as "replaced". Every request completes
    with identical output, and the ring serves the next request."""
    for dead_after_s in (1.0, FailoverSpec().dead_after_s):
        plan = FaultPlan(8, (Injection("stall", "s1", 20, 5.0),))
        spec = failover_spec(
            model_dir, standbys=False, join_deadline_s=30, dead_after_s=dead_after_s
        )
        out = run_scenario(spec, model_dir, plan)
        assert out.injector.fired, f"{plan}: the fault never fired"
        for i, result in enumerate(out.results):
            assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
            assert result.token_ids == references[i], f"{plan}: request {i} output differs"
        kinds = [(r.kind, r.lost, r.replacement) for r in out.recoveries]
        assert ("rejoin", "s1", "s1") in kinds, f"{plan}: {out.recoveries}"
        assert all(k[0] in ("rejoin", "relink") for k in kinds), f"{plan}: {kinds}"
        said = [e for e in out.events if "was replaced by" in e or " replaced s1" in e]
        assert said == [], f"{plan}: {out.events}"
        assert any("s1 rejoined its slot s1" in e for e in out.events), out.events


def test_a_ring_whose_lap_outlasts_retry_after_s_still_answers(
    model_dir: Path, references: list[tuple[int, ...]]
) -> None:
    """Every edge 1 s one way (a lap over 4 s) against ``retry_after_s`` 3 s: the ring is
    slow, not lossy. The first re-send for silence is premature (its epoch's verdict arrives
    after it), so the request waits longer from then on and every output is right. Before,
    each re-send made the verdict about to arrive stale: no request progressed, and each
    failed with "gave up after 8 re-sends" (the soak's swarm after a takeover, issue 40)."""
    spec = failover_spec(model_dir, dead_after_s=10.0, latency_ms=1000.0)
    out = run_scenario(spec, model_dir, FaultPlan(0, ()))
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"request {i} failed: {result}"
        assert result.token_ids == references[i], f"request {i} output differs"
    assert any(e.startswith("resync") for e in out.events), out.events  # it did re-send once

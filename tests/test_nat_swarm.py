"""A ring whose stages accept no inbound connection, in one process: every stage behind a
``Firewall`` (no dial reaches it), so the coordinator's edge to stage 0 is dialled back by
stage 0, stage-to-stage edges meet at the relay (the coordinator), and the tail dials the
coordinator as always. The output is the single-process reference's, token for token, and it
stays so when a stage behind NAT is killed and a standby behind NAT is spliced in.

Charter: memory networks only; every test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from procs import free_ports, run_shard
from shard.compute.offload import inline_compute
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec, load_spec
from shard.testing import Firewall, generate_watching, make_tiny_checkpoint
from shard.testing.faults import FaultInjector, FaultPlan, Injection
from shard.transport import MemoryNetwork
from shard.transport.nat import NatNetwork
from test_ring import reference

SPECS = Path(__file__).resolve().parent.parent / "specs"
PROMPTS = ([5, 17, 99, 3], [200, 31, 7, 7, 7, 64, 12, 1, 150, 9, 44])
DEADLINE_S = 60.0


def nat_spec(model_dir: Path, *, standby: bool = False, relay: str | None = None) -> SwarmSpec:
    """Three stages behind NAT (``reachable = false``); optionally a hot standby for s1, also
    behind NAT; the relay is the coordinator unless ``relay`` names another node."""
    data: dict[str, Any] = {
        "swarm": {"name": "nat", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 128, "prefill_chunk": 4, "max_sessions": 16},
        "coordinator": {"name": "coord", "listen": "10.0.0.1:9000"},
        "stage": [
            {"name": f"s{i}", "listen": f"192.168.{i}.2:9001", "layers": [i, i + 1]}
            for i in range(3)
        ]
        + [{"name": "s3", "listen": "10.0.0.4:9001", "layers": [3, 4]}],
        "failover": {"heartbeat_s": 0.25, "dead_after_s": 1.0},
    }
    for stage in data["stage"][:3]:
        stage["reachable"] = False
    if standby:
        data["standby"] = [
            {"name": "w1", "listen": "192.168.9.2:9001", "layers_of": "s1", "reachable": False}
        ]
    if relay is not None:
        data["swarm"]["relay"] = relay
    return SwarmSpec.from_dict(data, source="nat.toml")


def firewall(spec: SwarmSpec) -> Firewall:
    nodes = (*spec.stages, *spec.standbys)
    return Firewall(MemoryNetwork(), [str(n.listen) for n in nodes if not n.reachable])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("nat"), seed=9, n_layers=4)


@pytest.mark.parametrize("relay", [None, "s3"], ids=["relay=coord", "relay=s3"])
async def test_a_ring_behind_nat_gives_the_reference_output(
    model_dir: Path, relay: str | None
) -> None:
    """Callback, relayed and direct edges together carry a ring identical to the reference;
    nothing ever dialled a node behind NAT."""
    spec = nat_spec(model_dir, relay=relay)
    net = firewall(spec)
    got = []
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(
                    spec, model_dir=model_dir, network=net, task_status=task_status
                )
            )
            for prompt in PROMPTS:
                got.append((await handle.coordinator.generate(prompt, max_tokens=16)).token_ids)
            assert handle.scheduler is not None
            ring = handle.scheduler.statistics().slots
            nursery.cancel_scope.cancel()
    want = [reference(model_dir, p, max_tokens=16, max_len=128, prefill_chunk=4) for p in PROMPTS]
    assert got == want
    assert net.refused == []
    assert [holder for _, holder in ring] == ["s0", "s1", "s2", "s3"]


def test_a_stage_behind_nat_killed_mid_request_is_replaced_by_a_standby_behind_nat(
    model_dir: Path,
) -> None:
    """s1 dies halfway through a request; w1 (also behind NAT) is spliced in: it meets s2 at
    the relay, s0 is rewired to nat:w1 through the relay with replay, and the request ends
    with the reference output."""
    spec = nat_spec(model_dir, standby=True)
    net = firewall(spec)
    prompt = PROMPTS[1]
    want = reference(model_dir, prompt, max_tokens=40, max_len=128, prefill_chunk=4)
    seen: list[int] = []
    nats: dict[str, NatNetwork] = {}

    def keep(name: str, network: Any) -> Any:
        assert isinstance(network, NatNetwork)
        nats[name] = network
        return network

    async def main() -> tuple[tuple[int, ...], Any]:
        scopes: dict[str, trio.CancelScope] = {}
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle: CoordinatorHandle = await nursery.start(
                    lambda task_status: run_swarm(
                        spec,
                        model_dir=model_dir,
                        network=net,
                        emulate_latency=False,
                        wrap=keep,
                        scopes=scopes,
                        task_status=task_status,
                    )
                )

                def tokens(ids: tuple[int, ...]) -> None:
                    seen.extend(ids)
                    if len(seen) >= 8 and not scopes["s1"].cancel_called:
                        scopes["s1"].cancel()  # s1 dies

                done = await generate_watching(handle.coordinator, prompt, tokens, max_tokens=40)
                assert handle.scheduler is not None
                stats = handle.scheduler.statistics()
                nursery.cancel_scope.cancel()
        return done.token_ids, stats

    got, stats = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(seen) < len(want) + 1
    assert got == want
    (recovery,) = stats.recoveries
    assert (recovery.lost, recovery.replacement, recovery.kind) == ("s1", "w1", "hot")
    assert net.refused == []
    assert nats["w1"].statistics().relayed == 1  # its own edge, to s2
    assert nats["s0"].statistics().relayed == 2  # to s1, then rewired to w1


@pytest.mark.parametrize(
    ("sender", "edge"), [("coord", "called back"), ("s0", "relayed")], ids=["callback", "relay"]
)
def test_a_severed_edge_behind_nat_is_dialled_again_the_same_way(
    model_dir: Path, sender: str, edge: str
) -> None:
    """The connection under the coordinator's edge to s0 (called back) or s0's edge to s1
    (relayed) is cut mid-request: the scheduler relinks, the node behind NAT dials out again
    (a fresh callback, a fresh pair), and the request ends with the reference output."""
    spec = nat_spec(model_dir)
    net = firewall(spec)
    injector = FaultInjector(FaultPlan(0, (Injection("sever", sender, 12),)))
    prompt = PROMPTS[1]
    want = reference(model_dir, prompt, max_tokens=24, max_len=128, prefill_chunk=4)
    nats: dict[str, NatNetwork] = {}

    def wrap(name: str, network: Any) -> Any:
        assert isinstance(network, NatNetwork)
        nats[name] = network
        return injector.wrap(name, network)

    async def main() -> tuple[tuple[int, ...], Any]:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle: CoordinatorHandle = await nursery.start(
                    lambda task_status: run_swarm(
                        spec,
                        model_dir=model_dir,
                        network=net,
                        emulate_latency=False,
                        wrap=wrap,
                        scopes=injector.scopes,
                        task_status=task_status,
                    )
                )
                done = await handle.coordinator.generate(prompt, max_tokens=24)
                assert handle.scheduler is not None
                stats = handle.scheduler.statistics()
                nursery.cancel_scope.cancel()
        return done.token_ids, stats

    got, stats = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert injector.fired, f"the sever on {sender}'s {edge} edge never fired"
    assert got == want
    (recovery,) = stats.recoveries
    assert (recovery.lost, recovery.kind) == (sender, "relink")
    assert net.refused == []
    routes = nats[sender].statistics()
    assert (routes.callbacks, routes.relayed) == ((2, 0) if sender == "coord" else (0, 2))


@pytest.mark.slow
async def test_swarm_run_of_the_shipped_nat_spec_matches_local(tmp_path: Path) -> None:
    """`shard swarm run specs/local-nat.toml` (its ports made free, a tiny model) prints the
    tokens of `shard generate --local`: the launcher's processes take the NAT routes."""
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", seed=9, n_layers=3)
    text = (SPECS / "local-nat.toml").read_text()
    for old, new in zip(range(7750, 7754), free_ports(4), strict=True):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    text = text.replace("max_len = 2048", "max_len = 256")  # the tiny model's context: 512
    spec = tmp_path / "local-nat.toml"
    spec.write_text(text)
    assert [s.reachable for s in load_spec(spec).stages] == [False, False, True]
    prompt = "the river runs to the sea"
    common = ("--json", "--max-tokens", "12", "--model", str(model_dir))
    local = await run_shard(
        "generate", "--local", "--max-len", "256", *common, prompt, timeout_s=120
    )
    swarm = await run_shard("swarm", "run", str(spec), "--prompt", prompt, *common, timeout_s=120)
    assert local.returncode == 0, local.describe()
    assert swarm.returncode == 0, swarm.describe()
    assert swarm.stragglers == ()
    (want,), (got,) = local.json_records(), swarm.json_records()
    assert got["token_ids"] == want["token_ids"]

"""A ring behind NAT, with real processes in network namespaces the test creates.

The topology (``nat_lab``): a "public" namespace holding the coordinator (and so the relay)
and the client, a "router" namespace doing iptables MASQUERADE, and one "home" namespace per
stage behind it. The router forwards only what a home starts (new connections from a home to
the public side, and their replies) and each home drops new inbound connections (INPUT
policy), so no stage accepts an inbound connection from anywhere — the test checks that
first, by dialling a stage's listener from the public side and from the other home. The
stages have ``reachable = false``: the coordinator's edge to s0 is dialled back by s0, the
edge s0 -> s1 meets at the relay, the tail dials the coordinator as always.

- plain wire: the output equals ``shard generate --local``;
- sealed wire, with the coordinator's relay replaced by a tampering one
  (``shard.testing.nat_node``):
  it flips one bit of the first activation frame it carries, s1 rejects the frame (the
  sealer's tag fails: ``TamperedFrame``), the edge is re-dialled through the relay, the output
  still equals ``--local``, and the relay never carried a plaintext wire frame.

Needs root (CAP_NET_ADMIN) and ``ip`` and ``iptables``: ``ops/bootstrap`` installs
``iproute2`` and ``iptables`` when missing; without them this test fails, loudly, saying so —
it never skips. Loopback and its own namespaces only; namespaces are named ``shnat<pid>-*``
and deleted on every way out, processes are killed by PID (``tests/procs.py``), every wait is
bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from procs import SHARD, LineReader, run_shard, started_shard
from shard.nodes.compose import provision_local

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea"
MAX_TOKENS = 24
MAX_LEN = 256
RUN_S = 60.0
NAT_NODE = ("-m", "shard.testing.nat_node")
PREFIX = f"shnat{os.getpid()}"
PUBLIC_IP = "10.200.0.1"  # the coordinator (and relay); the router is .254
COORD_PORT = 7700
STAGE_PORT = 7701


def require_lab() -> None:
    """Root and the tools, or a loud failure saying how to get them (never a skip)."""
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"test_nat_procs needs {' and '.join(missing)} (packages iproute2, iptables): run "
            "ops/bootstrap (it installs them with apt-get when missing) or "
            "`apt-get install iproute2 iptables`; this test does not skip"
        )
    if os.geteuid() != 0:
        pytest.fail("test_nat_procs creates network namespaces: run it as root (CI does)")


@attrs.frozen
class Lab:
    public: str
    router: str
    homes: tuple[str, ...]

    def home_ip(self, i: int) -> str:
        return f"192.168.{i + 1}.2"

    def inside(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)


async def sh(*cmd: str) -> None:
    """Run one set-up command; a failure names it and says why."""
    with trio.fail_after(20):
        done = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"`{' '.join(cmd)}` failed: {done.stderr.decode(errors='replace')}")


async def _build(lab: Lab, made: list[str]) -> None:
    for ns in (lab.public, lab.router, *lab.homes):
        await sh("ip", "netns", "add", ns)
        made.append(ns)
        await sh("ip", "-n", ns, "link", "set", "lo", "up")
    pub, rtr = lab.public, lab.router
    await sh("ip", "link", "add", "wan0", "netns", pub, "type", "veth", "peer", "name", "wan0",
             "netns", rtr)  # fmt: skip
    await sh("ip", "-n", pub, "addr", "add", f"{PUBLIC_IP}/24", "dev", "wan0")
    await sh("ip", "-n", rtr, "addr", "add", "10.200.0.254/24", "dev", "wan0")
    for ns in (pub, rtr):
        await sh("ip", "-n", ns, "link", "set", "wan0", "up")
    # the public side knows the way to the homes' addresses: its packets reach the router,
    # which drops them (as a home router drops unsolicited inbound traffic)
    await sh("ip", "-n", pub, "route", "add", "192.168.0.0/16", "via", "10.200.0.254")
    ipt = (*lab.inside(rtr), "iptables")
    await sh(*lab.inside(rtr), "sysctl", "-qw", "net.ipv4.ip_forward=1")
    await sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
    await sh(*ipt, "-P", "FORWARD", "DROP")
    await sh(*ipt, "-A", "FORWARD", "-o", "wan0", "-j", "ACCEPT")  # a home starts it: out
    await sh(*ipt, "-A", "FORWARD", "-i", "wan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
    for i, home in enumerate(lab.homes):
        gw, me = f"192.168.{i + 1}.1", lab.home_ip(i)
        await sh("ip", "link", "add", "lan0", "netns", home, "type", "veth", "peer", "name",
                 f"lan{i}", "netns", rtr)  # fmt: skip
        await sh("ip", "-n", home, "addr", "add", f"{me}/24", "dev", "lan0")
        await sh("ip", "-n", rtr, "addr", "add", f"{gw}/24", "dev", f"lan{i}")
        await sh("ip", "-n", home, "link", "set", "lan0", "up")
        await sh("ip", "-n", rtr, "link", "set", f"lan{i}", "up")
        await sh("ip", "-n", home, "route", "add", "default", "via", gw)
        hipt = (*lab.inside(home), "iptables")
        await sh(*hipt, "-P", "INPUT", "DROP")  # no inbound connection, from anywhere
        await sh(*hipt, "-A", "INPUT", "-i", "lo", "-j", "ACCEPT")
        await sh(*hipt, "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                 "-j", "ACCEPT")  # fmt: skip


@asynccontextmanager
async def nat_lab(n_homes: int) -> AsyncIterator[Lab]:
    """The namespaces of the module docstring; deleted (with their veths) on the way out."""
    require_lab()
    lab = Lab(f"{PREFIX}-pub", f"{PREFIX}-rtr", tuple(f"{PREFIX}-h{i}" for i in range(n_homes)))
    made: list[str] = []
    try:
        await _build(lab, made)
        yield lab
    finally:
        with trio.CancelScope(shield=True):
            for ns in reversed(made):
                await trio.run_process(("ip", "netns", "del", ns), check=False)


async def can_connect(lab: Lab, ns: str, host: str, port: int) -> bool:
    """Whether a TCP connection from namespace ``ns`` to ``host:port`` opens within 1.5 s."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=1.5).close()\n"
        "except OSError:\n"
        "    sys.exit(3)\n"
    )
    with trio.fail_after(20):
        done = await trio.run_process((*lab.inside(ns), sys.executable, "-c", code), check=False)
    assert done.returncode in (0, 3), f"probe from {ns} failed: {done.returncode}"
    return done.returncode == 0


def spec_file(path: Path, lab: Lab, model_dir: Path, *, secure: bool) -> Path:
    """Coordinator in the public namespace; s0, s1 in their homes, reachable = false."""
    lines = [
        "[swarm]",
        'name = "nat"',
        f"model = {json.dumps(str(model_dir))}",
        f"insecure = {'false' if secure else 'true'}",
        "[limits]",
        f"max_len = {MAX_LEN}",
        "connect_timeout_s = 5.0",
        "[failover]",
        "dead_after_s = 3.0",  # a loaded 2-core machine: no false deaths; a relink waits this
        "[coordinator]",
        'name = "coord"',
        f'listen = "{PUBLIC_IP}:{COORD_PORT}"',
    ]
    keys = None
    if secure:
        roles = {"coord": ["coordinator"], "s0": ["stage"], "s1": ["stage"], "client": ["client"]}
        keys = provision_local(path.parent / "keys", swarm="nat", nodes=roles, now=time.time())
        lines += [f'key = "{keys.key("coord")}"', f'token = "{keys.token("coord")}"']
    for i, (first, last) in enumerate(((0, 2), (2, 4))):
        lines += [
            "[[stage]]",
            f'name = "s{i}"',
            f'listen = "{lab.home_ip(i)}:{STAGE_PORT}"',
            "reachable = false",
            f"layers = [{first}, {last}]",
        ]
        if keys is not None:
            lines += [f'key = "{keys.key(f"s{i}")}"', f'token = "{keys.token(f"s{i}")}"']
    if keys is not None:
        lines += [
            "[trust]",
            f'authority = "{keys.authority_pub}"',
            f'client_key = "{keys.key("client")}"',
            f'client_token = "{keys.token("client")}"',
        ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def local_ids(model_dir: Path) -> list[int]:
    done = await run_shard(
        "generate", "--local", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS),
        "--max-len", str(MAX_LEN), "--ignore-eos", "--json", PROMPT, timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    (record,) = done.json_records()
    ids: list[int] = record["token_ids"]
    return ids


async def ring_behind_nat(
    tmp_path: Path, model_dir: Path, *, secure: bool, coordinator: Sequence[str]
) -> tuple[list[int], dict[str, str]]:
    """Form the ring in a fresh lab, check that no stage can be dialled, run one request from
    the public namespace; its token ids and every node's log."""
    logs = {name: tmp_path / f"{name}.err" for name in ("coord", "s0", "s1")}
    async with nat_lab(2) as lab, AsyncExitStack() as stack:
        spec = spec_file(tmp_path / "nat.toml", lab, model_dir, secure=secure)
        common = ("--spec", str(spec), "--model", str(model_dir))
        coord = await stack.enter_async_context(
            started_shard(
                "-v",
                "up",
                "--role",
                "coordinator",
                *common,
                stderr_path=logs["coord"],
                prefix=lab.inside(lab.public),
                program=coordinator,
            )
        )
        for i in range(2):
            await stack.enter_async_context(
                started_shard(
                    "-v",
                    "up",
                    "--role",
                    "stage",
                    "--node",
                    f"s{i}",
                    *common,
                    stderr_path=logs[f"s{i}"],
                    prefix=lab.inside(lab.homes[i]),
                )
            )
        with trio.fail_after(RUN_S):  # ready: the ring is connected end to end
            await LineReader(coord.stdout).line_starting("SHARD READY")
        # the stages really accept nothing: not from the public side, not from the other home
        for ns, i in ((lab.public, 0), (lab.public, 1), (lab.homes[1], 0)):
            assert not await can_connect(lab, ns, lab.home_ip(i), STAGE_PORT), (ns, i)
        assert await can_connect(lab, lab.homes[0], PUBLIC_IP, COORD_PORT)  # out: fine
        done = await run_shard(
            "generate", "--spec", str(spec), "--json", "--max-tokens", str(MAX_TOKENS),
            "--ignore-eos", PROMPT, timeout_s=RUN_S, prefix=lab.inside(lab.public),
        )  # fmt: skip
        assert done.returncode == 0, done.describe() + logs["coord"].read_text()[-3000:]
        (record,) = done.json_records()
    return record["token_ids"], {name: path.read_text() for name, path in logs.items()}


def assert_formed_through_nat(log: dict[str, str]) -> None:
    """Both stages registered at the relay; the edge s0 -> s1 was relayed; the coordinator's
    edge to s0 was dialled back."""
    coord = log["coord"]
    assert "relay coord: s0 registered" in coord and "relay coord: s1 registered" in coord, coord
    assert "relay coord: relaying" in coord, coord
    assert f"s0: answered coord's call: dialled it back at {PUBLIC_IP}" in log["s0"], log["s0"]
    assert f"s1: answered s0's call: met it at relay {PUBLIC_IP}" in log["s1"], log["s1"]


async def test_a_ring_behind_nat_gives_the_local_output(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Plain wire: stages behind MASQUERADE that accept no inbound connection form a ring
    (callback and relayed edges) whose output is token-identical to --local."""
    model_dir = tiny_checkpoint(seed=11, n_layers=4)
    want = await local_ids(model_dir)
    got, log = await ring_behind_nat(tmp_path, model_dir, secure=False, coordinator=SHARD)
    assert got == want
    assert_formed_through_nat(log)


async def test_a_tampering_relay_is_caught_on_the_sealed_wire(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Sealed wire, a relay that flips a bit of the first activation frame: s1 rejects it
    (TamperedFrame), the edge is re-dialled, the output still equals --local, and the relay
    never carried a plaintext frame."""
    model_dir = tiny_checkpoint(seed=11, n_layers=4)
    want = await local_ids(model_dir)
    tampering = (sys.executable, *NAT_NODE, "tamper")
    got, log = await ring_behind_nat(tmp_path, model_dir, secure=True, coordinator=tampering)
    assert_formed_through_nat(log)
    assert "tampering relay: flipped a bit" in log["coord"], log["coord"]
    assert "watching relay: carried a plaintext wire frame" not in log["coord"]
    assert "TamperedFrame" in log["s1"], log["s1"]
    assert got == want


def test_without_the_tools_the_nat_test_fails_saying_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ip or iptables: a failure naming the packages and ops/bootstrap, never a skip."""
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(pytest.fail.Exception, match=r"ip and iptables.*ops/bootstrap"):
        require_lab()

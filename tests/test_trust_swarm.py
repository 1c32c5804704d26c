"""The ring on the secure wire: in one process over real WebSockets, and as real processes
(``shard swarm run``), token for token equal to the single-process reference; a node whose
own token is expired stops at start with one line saying so.

Charter: 127.0.0.1 only, free ports; every run bounded; keys and tokens made fresh per test
(``shard.nodes.compose.provision_local``) in the test's temporary directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

from procs import free_ports, run_shard, write_spec
from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.compose import LocalTrust, node_network, provision_local
from shard.nodes.coordinator import CoordinatorHandle, run_coordinator, run_stage
from shard.spec.swarm import SwarmSpec, load_spec
from shard.transport import Network
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.admission import AdmissionToken, issue
from shard.trust.identity import NodeIdentity
from shard.trust.receipt_check import ReceiptPins, verify_run

PROMPTS = ([5, 17, 99, 3], [200, 31, 7, 7, 7, 64, 12, 1, 150, 9, 44])
DEADLINE_S = 90.0
RUN_S = 150.0


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=3, n_layers=4)


def provision(directory: Path, stages: int, swarm: str = "test") -> LocalTrust:
    nodes: dict[str, Sequence[str]] = {"coord": ["coordinator"], "client": ["client"]}
    nodes.update({f"s{i}": ["stage"] for i in range(stages)})
    return provision_local(directory, swarm=swarm, nodes=nodes, now=time.time())


def secure_spec(model_dir: Path, blocks: list[tuple[int, int]], keys: LocalTrust) -> SwarmSpec:
    """A secure spec on free loopback ports whose nodes use ``keys``."""
    ports = free_ports(len(blocks) + 1)

    def node(name: str) -> dict[str, str]:
        return {"name": name, "key": str(keys.key(name)), "token": str(keys.token(name))}

    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": False},
        "trust": {"authority": str(keys.authority_pub)},
        "limits": {"max_len": 128, "prefill_chunk": 4, "connect_timeout_s": 5.0},
        "coordinator": {**node("coord"), "listen": f"127.0.0.1:{ports[0]}"},
        "stage": [
            {**node(f"s{i}"), "listen": f"127.0.0.1:{ports[i + 1]}", "layers": list(b)}
            for i, b in enumerate(blocks)
        ],
    }
    return SwarmSpec.from_dict(data, source="secure.toml")


def reference(model_dir: Path, prompt: list[int], max_tokens: int) -> tuple[int, ...]:
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    result = generate_reference(
        model,
        prompt,
        eos_ids=config.eos_token_ids,
        max_tokens=max_tokens,
        max_len=128,
        prefill_chunk=4,
    )
    return result.token_ids


async def test_in_process_ring_on_the_secure_wire_matches_reference(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Coordinator and three stages, each with its own key and token on its own secure
    WebSocket network, give the reference's greedy tokens; the run receipt, whose stage
    receipts crossed the secure wire, verifies pinned to the swarm's authority."""
    keys = provision(tmp_path / "keys", 3)
    spec = secure_spec(llama_dir, [(0, 1), (1, 3), (3, 4)], keys)
    outputs = []
    receipts = []
    with trio.fail_after(DEADLINE_S):
        async with AsyncExitStack() as stack:
            nets: dict[str, Network] = {}
            for stage in spec.stages:
                nets[stage.name] = await stack.enter_async_context(
                    node_network(spec, stage.name, "stage")
                )
            coord = await stack.enter_async_context(node_network(spec, "coord", "coordinator"))
            assert all(isinstance(n, SecureWebSocketNetwork) for n in (*nets.values(), coord))
            nursery = await stack.enter_async_context(trio.open_nursery())
            for stage in spec.stages:
                nursery.start_soon(_stage, spec, stage.name, nets[stage.name], llama_dir)
            handle: CoordinatorHandle = await nursery.start(_coordinator, spec, coord, llama_dir)
            for prompt in PROMPTS:
                done = await handle.coordinator.generate(prompt, max_tokens=16, receipt=True)
                outputs.append(done.token_ids)
                receipts.append(done.receipt)
            nursery.cancel_scope.cancel()
    assert outputs == [reference(llama_dir, p, 16) for p in PROMPTS]
    assert all(len(out) > 0 for out in outputs)
    for receipt, out in zip(receipts, outputs, strict=True):
        assert receipt is not None and receipt.output_ids == out
        assert verify_run(receipt, ReceiptPins(authority=keys.authority.public)).unpinned == ()


async def _stage(spec: SwarmSpec, name: str, network: Network, model_dir: Path) -> None:
    await run_stage(spec, name, network=network, model_dir=model_dir, startup_timeout_s=30)


async def _coordinator(
    spec: SwarmSpec,
    network: Network,
    model_dir: Path,
    *,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    await run_coordinator(
        spec, network=network, model_dir=model_dir, startup_timeout_s=30, task_status=task_status
    )


def secure_spec_file(path: Path, model_dir: Path, blocks: list[tuple[int, int]]) -> Path:
    """``procs.write_spec``'s spec, made secure: [trust], and a key and token per node."""
    keys = provision(path.parent / "keys", len(blocks))
    write_spec(path, model_dir=model_dir, blocks=blocks, limits={"max_len": 256})
    lines = []
    for line in path.read_text().splitlines():
        lines.append(line.replace("insecure = true", "insecure = false"))
        if line.startswith("name = ") and line != 'name = "test"':
            name = line.split('"')[1]
            lines += [f'key = "{keys.key(name)}"', f'token = "{keys.token(name)}"']
    lines += [
        "",
        "[trust]",
        f'authority = "{keys.authority_pub}"',
        f'client_key = "{keys.key("client")}"',
        f'client_token = "{keys.token("client")}"',
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
async def test_swarm_run_on_the_secure_wire_matches_local(llama_dir: Path, tmp_path: Path) -> None:
    """`shard swarm run` on a secure spec (three processes, encrypted links) prints the tokens
    of `shard generate --local`, and no process outlives it."""
    spec = secure_spec_file(tmp_path / "spec.toml", llama_dir, [(0, 3), (3, 4)])
    assert not load_spec(spec).insecure
    prompt = "The capital of France is"
    common = ("--json", "--max-tokens", "12", "--model", str(llama_dir))
    results: dict[str, Any] = {}

    async def run(key: str, *args: str) -> None:
        results[key] = await run_shard(*args, timeout_s=RUN_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "local", "generate", "--local", "--max-len", "256", *common, prompt)
        nursery.start_soon(run, "swarm", "swarm", "run", str(spec), "--prompt", prompt, *common)
    local, swarm = results["local"], results["swarm"]
    assert local.returncode == 0, local.describe()
    assert swarm.returncode == 0, swarm.describe()
    assert swarm.stragglers == ()
    (want,), (got,) = local.json_records(), swarm.json_records()
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) > 1
    assert got["text"] == want["text"]
    assert "insecure" not in swarm.stderr  # no plaintext warning on a secure swarm


@pytest.mark.slow
async def test_node_with_expired_token_stops_at_start_in_one_line(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`shard up` with an expired token exits 1 with one line naming the node, the token file,
    the expiry and the `shard admit` fix, before loading anything."""
    spec = secure_spec_file(tmp_path / "spec.toml", llama_dir, [(0, 4)])
    keys = tmp_path / "keys"
    old = AdmissionToken.load(keys / "s0.token")
    authority = NodeIdentity.load(keys / "authority.key")
    expired = issue(
        authority,
        node_pub=old.node_pub,
        swarm=old.swarm,
        roles=old.roles,
        not_before=1,
        expires=2,
        serial=99,
    )
    (keys / "s0.token").unlink()
    expired.save(keys / "s0.token")
    done = await run_shard(
        "up", "--role", "stage", "--spec", str(spec), "--node", "s0", "--model", str(llama_dir),
        timeout_s=60,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.describe()
    assert len(lines) == 1, done.describe()
    assert lines[0].startswith("shard: error: s0: cannot join: its token ")
    assert "expired at 1970-01-01T00:00:02Z" in lines[0] and "shard admit" in lines[0]

"""Receipts for the receipt tests: real ones from an in-process ring (secure or not), and
forgeries — re-signed with other keys, or fabricated from nothing — built the way an attacker
would, with only public information and the attacker's own keys."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from shard.coordinator.coordinator import Coordinator
from shard.messages import EdgeRecord, NodeName, RunReceipt, StageReceipt, VerdictRecord
from shard.nodes.compose import LocalTrust, provision_local
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.trust.admission import issue
from shard.trust.identity import NodeIdentity
from shard.trust.receipts import (
    Chain,
    chunk_record,
    hash_ids,
    ids_bytes,
    job_id,
    sign_run,
    sign_stage,
    verdict_chunk_record,
)

DEADLINE_S = 60.0
PROMPT = [5, 6, 7, 5, 6, 7, 5]
BLOCKS = ((0, 1), (1, 3), (3, 4))


def ring_data(model_dir: Path, *, draft: str = "none", name: str = "receipts") -> dict[str, Any]:
    """An insecure three-stage spec (as a dict) over the in-process memory network."""
    return {
        "swarm": {"name": name, "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 128, "prefill_chunk": 4},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9200"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9201 + i}", "layers": list(block)}
            for i, block in enumerate(BLOCKS)
        ],
        "speculation": {"draft": draft, **({"draft_layers": 2} if draft == "auto" else {})},
    }


def ring_spec(model_dir: Path, draft: str = "none") -> SwarmSpec:
    return SwarmSpec.from_dict(ring_data(model_dir, draft=draft), source="receipts.toml")


def provision(directory: Path, swarm: str = "receipts") -> LocalTrust:
    """An authority, and a key and token for the coordinator and each stage."""
    nodes = {"coord": ["coordinator"], **{f"s{i}": ["stage"] for i in range(len(BLOCKS))}}
    return provision_local(directory, swarm=swarm, nodes=nodes, now=time.time())


def secure_spec(model_dir: Path, keys: LocalTrust) -> SwarmSpec:
    """``ring_spec`` made secure: [trust] names ``keys``' authority, each node its key/token
    (the in-process network stays memory: what matters here is who signs)."""
    data = ring_data(model_dir)
    data["swarm"]["insecure"] = False
    data["trust"] = {"authority": str(keys.authority_pub)}
    for node in (data["coordinator"], *data["stage"]):
        node["key"], node["token"] = str(keys.key(node["name"])), str(keys.token(node["name"]))
    return SwarmSpec.from_dict(data, source="secure-receipts.toml")


async def run_with_receipt(spec: SwarmSpec, model_dir: Path, **kw: Any) -> RunReceipt:
    """Run ``PROMPT`` through ``spec``'s ring in this process and return the run receipt."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=model_dir, task_status=task_status)
            )
            coordinator: Coordinator = handle.coordinator
            done = await coordinator.generate(PROMPT, receipt=True, **kw)
            nursery.cancel_scope.cancel()
    assert done.receipt is not None
    return done.receipt


def resign(
    receipt: RunReceipt,
    coordinator: NodeIdentity,
    stages: Sequence[NodeIdentity] | None = None,
    *,
    tokens: dict[bytes, str] | None = None,
    **changes: Any,
) -> RunReceipt:
    """``receipt`` with ``changes``, re-signed: each stage by ``stages[i]`` (None: the stage
    receipts stay as they are) and the whole by ``coordinator``; ``tokens`` maps a public key
    to the token text the forger attaches for it ("" when absent)."""
    tokens = tokens or {}
    stage_receipts = receipt.stages
    if stages is not None:
        stage_receipts = tuple(
            sign_stage(
                attrs.evolve(s, public_key=k.public.hex(), token=tokens.get(k.public, "")), k
            )
            for s, k in zip(receipt.stages, stages, strict=True)
        )
    same = coordinator.public.hex() == receipt.coordinator_key
    forged = attrs.evolve(
        receipt,
        stages=stage_receipts,
        coordinator_key=coordinator.public.hex(),
        coordinator_token=tokens.get(coordinator.public, receipt.coordinator_token if same else ""),
        **changes,
    )
    return sign_run(forged, coordinator)


def attacker_tokens(
    authority: NodeIdentity, swarm: str, coordinator: NodeIdentity, stages: Sequence[NodeIdentity]
) -> dict[bytes, str]:
    """Tokens a forger issues its own keys from its own authority, for ``swarm``."""
    now = int(time.time())
    out = {}
    for who, role in ((coordinator, "coordinator"), *((s, "stage") for s in stages)):
        token = issue(
            authority,
            node_pub=who.public,
            swarm=swarm,
            roles=[role],
            not_before=now - 60,
            expires=now + 86400,
            serial=len(out) + 1,
        )
        out[who.public] = token.to_text().rstrip("\n")
    return out


def fabricate(
    coordinator: NodeIdentity,
    stages: Sequence[NodeIdentity],
    *,
    swarm: str = "receipts",
    tokens: dict[bytes, str] | None = None,
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (9, 8),
    blocks: Sequence[tuple[int, int]] = ((0, 2), (2, 4)),
) -> RunReceipt:
    """A receipt for a run that never happened, internally consistent in every check a
    verifier can make without knowing whose keys to expect: chains link, blocks tile, the
    verdicts commit to the output, it ends at its maximum, every signature is valid."""
    tokens = tokens or {}
    nonce, prompt_hash = "ab" * 16, hash_ids(prompt)
    job = job_id(nonce, prompt_hash, max_tokens=len(output), stop_ids=())
    sent = Chain()
    sent.add(chunk_record(0, 0, 0, ids_bytes(prompt)))
    verdicts = (
        VerdictRecord(0, 0, 0, len(prompt), True, (output[0],), 0),
        VerdictRecord(0, 1, len(prompt), len(prompt) + 1, False, tuple(output[1:]), 0),
    )
    received = Chain()
    for v in verdicts:
        received.add(verdict_chunk_record(v))
    chains = [sent.value]
    for i in range(len(blocks) - 1):
        link = Chain()
        link.add(f"hidden {i}".encode())
        chains.append(link.value)
    chains.append(received.value)
    stage_receipts = tuple(
        sign_stage(
            StageReceipt(
                job, nonce, NodeName(f"s{i}"), key.public.hex(), f"10.0.0.{i}:1", first, last,
                1 + (i == len(blocks) - 1), 1 + (i == len(blocks) - 1), chains[i],
                chains[i + 1], 0.1, "cpu", token=tokens.get(key.public, ""),
            ),
            key,
        )
        for i, (key, (first, last)) in enumerate(zip(stages, blocks, strict=True))
    )  # fmt: skip
    run = RunReceipt(
        job=job, nonce=nonce, swarm=swarm, model="m", n_layers=blocks[-1][1],
        prompt_hash=prompt_hash, output_ids=tuple(output), output_hash=hash_ids(output),
        coordinator=NodeName("coord"), coordinator_key=coordinator.public.hex(),
        coordinator_token=tokens.get(coordinator.public, ""), signed_at=int(time.time()),
        sent_chain=sent.value, received_chain=received.value, stages=stage_receipts,
        verdicts=verdicts, edges=(EdgeRecord(NodeName("coord"), NodeName("s0"), 0.01),),
        tok_s=1.0, alpha=None, finish_reason="length", max_tokens=len(output), stop_ids=(),
        stop_at=-1,
    )  # fmt: skip
    return sign_run(run, coordinator)

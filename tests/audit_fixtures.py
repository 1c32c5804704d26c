"""Shared set-up for the spot-check tests: a tiny model cut into a head block and an audited
middle block, and a driver that pushes one session through them as the ring would — the
head's hidden states into the accused, the accused's output on — with an ``AuditSampler``
watching both edges, as the coordinator's does."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch

from shard.audit.auditor import audit_chunk
from shard.audit.compare import audit_nonce
from shard.audit.sampler import Accused, AuditSampler
from shard.audit.strikes import AuditStatistics
from shard.compute.tensors import from_wire, to_wire
from shard.failover.splice import Recovery
from shard.messages import NodeName, OpenSession, SessionId, Verify
from shard.messages.audit import AuditRequest, AuditVerdict
from shard.model.llama import StageModel
from shard.nodes.coordinator import CoordinatorHandle
from shard.spec.audit import AuditSpec
from shard.trust.identity import NodeIdentity
from shard.trust.receipts import ReceiptSigner

MAX_LEN = 512
PROMPT = 4  # the first chunk of a session: 4 prompt positions, then 1-token decode chunks
ACCUSED_KEY = NodeIdentity.from_seed(b"\x01" * 32)
AUDITOR_KEY = NodeIdentity.from_seed(b"\x02" * 32)
RATE = 0.1  # the rate the audit tests configure (the default, 0.05, only makes trials longer)
POLICY = AuditSpec(rate=RATE)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: torch's thread pool only contends on a shared machine (12x slower).
    Autouse in every test module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_audit(auditor: StageModel, req: AuditRequest) -> AuditVerdict:
    """``audit_chunk`` as the audit tests' auditor ``aud`` (CPU, ``POLICY``, a fixed clock)."""
    return audit_chunk(
        auditor,
        req,
        node=NodeName("aud"),
        identity=AUDITOR_KEY,
        device_class="cpu",
        policy=POLICY,
        now=1_700_000_000,
    )


def accused_record(block: StageModel, dtype: str = "float32", *, batched: bool = False) -> Accused:
    key = ACCUSED_KEY.public.hex()
    return Accused(NodeName("s1"), key, block.first, block.last, "cpu", dtype, batched)


@attrs.define
class Driver:
    """Pushes sessions through ``head`` -> ``accused`` (see the module docstring)."""

    head: StageModel
    accused: StageModel
    sampler: AuditSampler
    signer: ReceiptSigner | None = None
    #: told of each audited chunk as the sampler chooses it (a cheater that somehow learns
    #: when it was audited: ``shard.testing.cheats``' ``when_unaudited``)
    audited: Callable[[], None] | None = None

    def session(
        self,
        session: int,
        rng: random.Random,
        *,
        chunks: int,
        stop: Callable[[AuditRequest], bool] = lambda r: False,
    ) -> list[AuditRequest]:
        """Run ``chunks`` chunks (a prompt chunk, then decode chunks); return the requests
        the sampler made, stopping early when ``stop(request)`` says so."""
        sid = SessionId(session)
        vocab = self.head.config.vocab_size
        cache0, cache1 = self.head.new_cache(MAX_LEN), self.accused.new_cache(MAX_LEN)
        nonce = audit_nonce(self.sampler.commitment)
        opened = OpenSession(sid, MAX_LEN, job="ab" * 16, nonce=nonce)
        self.sampler.input(opened)
        if self.signer is not None:
            self.signer.opened(sid, opened.job, opened.nonce)
        out: list[AuditRequest] = []
        start = 0
        for seq in range(chunks):
            ids = [rng.randrange(vocab) for _ in range(PROMPT if seq == 0 else 1)]
            with torch.inference_mode():
                h = self.head(torch.tensor([ids]), start, cache0)  # [1, S, D]
            msg = Verify(sid, 0, seq, start, hidden=to_wire(h))  # type: ignore[arg-type]
            self.sampler.input(msg)
            with torch.inference_mode():
                y = self.accused(from_wire(msg.hidden), start, cache1)  # type: ignore[arg-type]
            sent = attrs.evolve(msg, hidden=to_wire(y))
            if self.signer is not None:
                assert msg.hidden is not None and sent.hidden is not None
                self.signer.received(sid, 0, seq, start, msg.hidden.data)
                self.signer.sent(sid, 0, seq, start, sent.hidden.data, 0.0)
            req = self.sampler.output(sent)
            start += len(ids)
            if req is not None:
                if self.audited is not None:
                    self.audited()
                out.append(req)
                if stop(req):
                    break
        return out


def tiny_blocks(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[StageModel, ...]:
    """(head [0, 2), middle [2, 4)) of the 6-layer tiny model, in ``dtype``."""
    from shard.model.loader import load_stage

    return load_stage(model_dir, 0, 2, dtype=dtype), load_stage(model_dir, 2, 4, dtype=dtype)


@attrs.define
class BatchedDriver:
    """Pushes several sessions at once through ``head`` -> ``accused`` as a batching stage's
    executor runs them (``shard.stage.batch.forward_batch``: every session's chunk of a step
    in one forward when ``batched``, else each alone), with ``sampler`` watching both edges.
    Inside ``shard.testing.cheats.batched_lies()`` a cheating ``accused`` lies in the batched
    forward too."""

    head: StageModel
    accused: StageModel
    sampler: AuditSampler
    batched: bool = True

    def run(self, sessions: list[int], rng: random.Random, *, chunks: int) -> list[AuditRequest]:
        """``chunks`` chunks per session (a prompt chunk, then decode chunks); the requests."""
        from shard.messages import Sampling
        from shard.stage.batch import Planned, forward_batch

        vocab = self.head.config.vocab_size
        caches = {}
        for s in sessions:
            sid = SessionId(s)
            nonce = audit_nonce(self.sampler.commitment)
            self.sampler.input(OpenSession(sid, MAX_LEN, job="ab" * 16, nonce=nonce))
            caches[sid] = (self.head.new_cache(MAX_LEN), self.accused.new_cache(MAX_LEN))
        out: list[AuditRequest] = []
        start = 0
        for seq in range(chunks):
            rows = PROMPT if seq == 0 else 1
            planned = []
            for sid, (c0, c1) in caches.items():
                ids = [rng.randrange(vocab) for _ in range(rows)]
                with torch.inference_mode():
                    h = self.head(torch.tensor([ids]), start, c0)  # [1, S, D]
                msg = Verify(sid, 0, seq, start, hidden=to_wire(h))  # type: ignore[arg-type]
                self.sampler.input(msg)
                planned.append(Planned(msg, h, c1, Sampling(), 0.0))
            if self.batched:
                outs = forward_batch(self.accused, None, planned)
            else:
                outs = [forward_batch(self.accused, None, [p])[0] for p in planned]
            for p, y in zip(planned, outs, strict=True):
                assert isinstance(y, torch.Tensor)
                req = self.sampler.output(attrs.evolve(p.msg, hidden=to_wire(y)))
                if req is not None:
                    out.append(req)
            start += rows
        return out


@attrs.frozen
class SwarmStats:
    """What an audited swarm test reads after its run: the scheduler's recoveries and members
    and the spot checker's strikes (``handle.scheduler``, ``handle.checks``)."""

    recoveries: tuple[Recovery, ...]
    members: tuple[tuple[NodeName, str, bool], ...]  # (node, role, alive)
    audits: AuditStatistics


def swarm_stats(handle: CoordinatorHandle) -> SwarmStats:
    assert handle.scheduler is not None and handle.checks is not None
    scheduler = handle.scheduler.statistics()
    return SwarmStats(scheduler.recoveries, scheduler.members, handle.checks.statistics())

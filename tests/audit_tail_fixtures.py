"""Shared set-up for the tail's spot-check tests: a tiny model cut into a head block and the
tail, and a driver that pushes several sessions through them as the ring would — prompt
chunks, then verify chunks of drafted ids — with the tail's verdicts made by the executor's
own functions (``shard.stage.chunks.plan``/``output`` and ``shard.stage.batch.forward_batch``,
all sessions' chunks of a step in one batched forward or each alone), and an
``AuditSampler`` watching the edge into the tail and its verdicts, as the coordinator's
does."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from audit_fixtures import ACCUSED_KEY
from shard.audit.compare import audit_nonce
from shard.audit.sampler import Accused, AuditSampler
from shard.compute.tensors import to_wire
from shard.messages import (
    ChunkSeq,
    Epoch,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    Verdict,
    Verify,
)
from shard.messages.audit import AuditRequest
from shard.model.kvcache import KVCache
from shard.model.llama import StageModel
from shard.stage.batch import forward_batch
from shard.stage.chunks import Session, output, plan
from shard.trust.receipts import ReceiptSigner, payload_of, verdict_payload

MAX_LEN = 96
SAMPLED = Sampling(temperature=0.8, top_p=0.9, top_k=40, seed=7)


def tail_record(tail: StageModel, *, batched: bool = False) -> Accused:
    return Accused(
        NodeName("s2"), ACCUSED_KEY.public.hex(), tail.first, tail.last, "cpu", "float32", batched
    )


def tail_blocks(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[StageModel, ...]:
    """(head [0, 4), tail [4, 6)) of the 6-layer tiny model, in ``dtype``."""
    from shard.model.loader import load_stage

    return load_stage(model_dir, 0, 4, dtype=dtype), load_stage(model_dir, 4, 6, dtype=dtype)


@attrs.define
class _Live:
    sid: SessionId
    head_cache: KVCache
    tail: Session
    tokens: list[int]  # committed: the prompt, then each verdict's ids
    seq: int = 0


@attrs.define
class TailDriver:
    """Pushes sessions through ``head`` -> ``tail`` (see the module docstring)."""

    head: StageModel
    tail: StageModel
    sampler: AuditSampler
    signer: ReceiptSigner | None = None
    batched: bool = False  # every step's chunks in one forward (else each alone)

    def run(
        self,
        sessions: list[tuple[int, Sampling]],
        rng: random.Random,
        *,
        steps: int,
        stop: Callable[[AuditRequest], bool] = lambda r: False,
    ) -> list[AuditRequest]:
        """A prompt of two prefill chunks, then ``steps - 2`` verify chunks, for every session
        at once; the requests the sampler made (stopping when ``stop`` says so)."""
        vocab = self.head.config.vocab_size
        live = [self._open(sid, sampling, rng, vocab) for sid, sampling in sessions]
        out: list[AuditRequest] = []
        for step in range(steps):
            msgs = [self._chunk(s, step, rng, vocab) for s in live]
            for req in self._tail_step(live, msgs):
                out.append(req)
                if stop(req):
                    return out
        return out

    def _open(self, sid: int, sampling: Sampling, rng: random.Random, vocab: int) -> _Live:
        session = SessionId(sid)
        opened = OpenSession(
            session, MAX_LEN, sampling, job="ab" * 16, nonce=audit_nonce(self.sampler.commitment)
        )
        self.sampler.input(opened)
        if self.signer is not None:
            self.signer.opened(session, opened.job, opened.nonce)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(4, 9))]
        cache = self.tail.new_cache(MAX_LEN)
        return _Live(session, self.head.new_cache(MAX_LEN), Session(cache, sampling), prompt)

    def _chunk(self, s: _Live, step: int, rng: random.Random, vocab: int) -> Prefill | Verify:
        """The session's next chunk, its hidden states from the head (alone)."""
        if step < 2:  # the prompt: two chunks, the second final
            half = len(s.tokens) // 2
            start, ids = (0, s.tokens[:half]) if step == 0 else (half, s.tokens[half:])
            draft: tuple[int, ...] | None = None
        else:
            start, draft = len(s.tokens) - 1, self._draft(s, rng, vocab)
            ids = [s.tokens[-1], *draft]
        with torch.inference_mode():
            h = self.head(torch.tensor([ids]), start, s.head_cache)  # [1, S, D]
        s.seq += 1
        epoch, seq = Epoch(0), ChunkSeq(s.seq)
        if draft is None:
            return Prefill(s.sid, epoch, seq, start, step == 1, hidden=to_wire(h))
        return Verify(s.sid, epoch, seq, start, hidden=to_wire(h), draft=draft)

    def _draft(self, s: _Live, rng: random.Random, vocab: int) -> tuple[int, ...]:
        """0-3 drafted ids: the greedy continuation (looked ahead on copies of the caches),
        one of them replaced by a random id half the time, so drafts are accepted, partly
        accepted and rejected."""
        k = rng.randrange(4)
        head_cache = KVCache(s.head_cache.k.clone(), s.head_cache.v.clone())
        tail_cache = KVCache(s.tail.cache.k.clone(), s.tail.cache.v.clone())
        token, draft = s.tokens[-1], []
        with torch.inference_mode():
            for i in range(k):
                at = len(s.tokens) - 1 + i
                h = self.head(torch.tensor([[token]]), at, head_cache)
                token = int(self.tail(h, at, tail_cache, head_rows=1)[0, -1].argmax())
                draft.append(token)
        if draft and rng.random() < 0.5:
            draft[rng.randrange(len(draft))] = rng.randrange(vocab)
        return tuple(draft)

    def _tail_step(self, live: list[_Live], msgs: list[Prefill | Verify]) -> list[AuditRequest]:
        """The tail's step, as its executor runs it; each verdict goes to the sampler."""
        sessions = {s.sid: s.tail for s in live}
        planned = [plan(self.tail, NodeName("s2"), sessions, m, 0.0) for m in msgs]
        for m in msgs:
            self.sampler.input(m)
            if self.signer is not None:
                assert m.hidden is not None
                payload = payload_of((), m.hidden.data)
                self.signer.received(m.session, m.epoch, m.seq, m.start, payload)
        if self.batched:
            choices = forward_batch(self.tail, None, planned)
        else:
            choices = [forward_batch(self.tail, None, [p])[0] for p in planned]
        out = []
        for s, m, choice in zip(live, msgs, choices, strict=True):
            verdict = output(m, choice, ())
            if not isinstance(verdict, Verdict):
                continue
            at = m.start + 1 if isinstance(m, Verify) else len(s.tokens)
            s.tokens[at:] = list(verdict.target_ids)
            if self.signer is not None:
                payload = verdict_payload(
                    verdict.target_ids, verdict.accepted, at=at, prefill=isinstance(m, Prefill)
                )
                self.signer.sent(m.session, m.epoch, m.seq, m.start, payload, 0.0)
            req = self.sampler.output(verdict)
            if req is not None:
                out.append(req)
        return out

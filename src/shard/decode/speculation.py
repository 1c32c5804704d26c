"""The speculative loop's pure core: one session's token stream, chunks in flight, epochs.

The coordinator keeps, per session, a *stream*: the committed tokens (prompt + output) followed
by drafted tokens not yet verified. A chunk feeds stream positions ``[start, start+n)`` to the
ring; the tail answers with the target's token for positions ``start+1 .. start+a+1``. Each
answer is compared with the stream at its position: equal — the token is committed and the
walk goes on; different — the target's token is committed, every draft after it is dropped,
and if later chunks are in flight (they were drafted assuming this one would be accepted) the
epoch is bumped so their verdicts, and the stages' queued copies, are recognised as stale.

Because a chunk's last answer (the "bonus" token) is compared with the first input of the next
chunk in flight, pipelined chunks chain exactly: nothing stale is ever committed.

**A branch** (``next_chunk(k, branch=...)``): where a draft is torn between two first guesses,
a second chunk at the same start carries the other continuation, sent (and so computed at
every stage) just before the main one. Both read the same committed text up to the start, so
the target's first answer is the same in both verdicts: if it is the branch's first guess the
branch's verdict is walked as the chunk (its guesses replace the main chunk's) and the main
chunk, computed after it and stale now, has overwritten the stages' KV past the start, so the
branch's committed tokens are fed again (``Chunk.known``: ids that are committed already,
answered again and never committed twice); otherwise the branch's verdict changes nothing.

Everything here is synchronous and deterministic; tests drive it with scripted verdicts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from shard.decode.state import DecodeState
from shard.messages import ChunkSeq, DraftQ, Epoch, Verdict

#: Rows a chunk that feeds committed tokens again keeps to (drafts dropped to fit): a
#: stage attends a chunk of at most this many rows as its rows' decode steps, bit for bit
#: (``shard.model.attention.ROWWISE_MAX_ROWS``), as it does every verify chunk of K <= 15.
REFEED_MAX_ROWS = 16


@attrs.frozen
class Chunk:
    """A verify chunk to send: stream positions ``[start, start+len(ids))``."""

    seq: ChunkSeq
    epoch: Epoch
    start: int
    ids: tuple[int, ...]
    q: tuple[DraftQ, ...] = ()  # the distributions ``draft`` was sampled from, or none
    known: int = 0  # leading guesses that are committed already: fed again, not guessed
    branch: Chunk | None = None  # sent just before this one: its other first guess
    is_branch: bool = False

    @property
    def draft(self) -> tuple[int, ...]:
        return self.ids[1:]


@attrs.frozen
class Outcome:
    """What one verdict did: ids committed (to emit), whether it was stale, whether the
    stream was corrected (``rejected``), and the new epoch when in-flight chunks died."""

    emitted: tuple[int, ...]
    stale: bool = False
    rejected: bool = False
    bumped_epoch: Epoch | None = None
    drafted: int = 0
    accepted: int = 0
    known: int = 0  # the chunk's guesses that were committed already (``Chunk.known``)
    branch: bool = False  # a branch's verdict: it won, or (``lost``) it changed nothing
    lost: bool = False


@attrs.define
class SpeculationStream:
    """One session's stream and in-flight chunks (see the module docstring)."""

    decode: DecodeState
    committed: list[int]
    max_len: int
    drafts: list[int] = attrs.field(factory=list)
    qs: list[DraftQ | None] = attrs.field(factory=list)  # per draft: what it was sampled from
    feed: int = 0
    epoch: Epoch = attrs.field(factory=lambda: Epoch(0))
    inflight: deque[Chunk] = attrs.field(factory=deque)
    next_seq: int = 0

    @classmethod
    def after_prefill(
        cls, decode: DecodeState, prompt: Sequence[int], *, max_len: int
    ) -> SpeculationStream:
        """The stream once the prompt is in every stage's KV (positions ``< len(prompt)``)."""
        return cls(decode=decode, committed=list(prompt), max_len=max_len, feed=len(prompt))

    # --- reading ---------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return len(self.committed) + len(self.drafts)

    def context(self) -> list[int]:
        """Committed tokens then drafts: what a proposer continues."""
        return self.committed + self.drafts

    def _q(self, position: int) -> DraftQ | None:
        i = position - len(self.committed)
        return self.qs[i] if 0 <= i < len(self.qs) else None

    def token(self, position: int) -> int | None:
        if position < len(self.committed):
            return self.committed[position]
        i = position - len(self.committed)
        return self.drafts[i] if i < len(self.drafts) else None

    @property
    def _last_needed(self) -> int:
        """The last position whose token may still be committed."""
        return min(self.decode.prompt_len + self.decode.max_tokens - 1, self.max_len)

    @property
    def depth(self) -> int:
        """Chunks in flight, a branch not counted (it rides with the chunk after it)."""
        return sum(not c.is_branch for c in self.inflight)

    def _known(self) -> int:
        """Committed tokens after the feed frontier's first: fed again by the next chunk."""
        return max(0, len(self.committed) - 1 - self.feed)

    def drafts_wanted(self, k: int) -> int:
        """How many more drafted tokens a chunk of ``k`` drafts at the feed frontier needs."""
        return max(0, self.feed + self._known() + k + 1 - self.length)

    # --- acting ----------------------------------------------------------------------------

    def add_drafts(self, tokens: Sequence[int], qs: Sequence[DraftQ] | None = None) -> None:
        """Append drafted tokens, with the distributions they were sampled from if they were
        (``qs``, one per token); a chunk carries q only when every draft in it has one."""
        if qs is not None and len(qs) != len(tokens):
            raise ValueError(f"{len(qs)} draft distributions for {len(tokens)} drafted tokens")
        self.drafts.extend(int(t) for t in tokens)
        self.qs.extend(qs if qs is not None else [None] * len(tokens))

    def next_chunk(self, k: int, branch: Sequence[int] = ()) -> Chunk | None:
        """The next chunk to send (up to ``k`` drafts, after any committed tokens it must feed
        again), or None when nothing can be fed. Feeds only what may still matter: never past
        ``max_tokens`` or the session's KV.

        ``branch``: another continuation of the committed text, for a chunk that starts at
        its last token and whose first guess differs; the branch (as long as it is, within
        the same bounds) is then ``Chunk.branch``, in flight just before it, to be sent
        first. Refused (no branch) for a chunk with draft distributions, whose verdict is
        not one draw per position.
        """
        if self.decode.done:
            return None
        known = self._known()
        n = min(
            min(known + k + 1, max(k + 1, REFEED_MAX_ROWS)),
            self.length - self.feed,
            self._last_needed - self.feed,
            self.max_len - self.feed,
        )
        if n <= 0:
            return None
        ids = tuple(t for p in range(self.feed, self.feed + n) if (t := self.token(p)) is not None)
        assert len(ids) == n
        qs = [self._q(p) for p in range(self.feed + 1, self.feed + n)]
        q = tuple(x for x in qs if x is not None) if all(x is not None for x in qs) else ()
        other = None
        if branch and not known and n > 1 and not q and not self.inflight and branch[0] != ids[1]:
            m = min(len(branch) + 1, self._last_needed - self.feed, self.max_len - self.feed)
            other = Chunk(
                ChunkSeq(self.next_seq),
                self.epoch,
                self.feed,
                (ids[0], *(int(t) for t in branch[: m - 1])),
                is_branch=True,
            )
            self.next_seq += 1
            self.inflight.append(other)
        seq = ChunkSeq(self.next_seq)
        chunk = Chunk(seq, self.epoch, self.feed, ids, q, min(known, n - 1), other)
        self.next_seq += 1
        self.feed += n
        self.inflight.append(chunk)
        return chunk

    def on_verdict(self, verdict: Verdict) -> Outcome:
        """Fold a verdict into the stream (see the module docstring)."""
        if verdict.epoch != self.epoch or not self.inflight:
            return Outcome(emitted=(), stale=True)
        chunk = self.inflight.popleft()
        if chunk.seq != verdict.seq or chunk.start != verdict.start:
            raise ValueError(
                f"verdict for chunk {verdict.seq}@{verdict.start} but chunk "
                f"{chunk.seq}@{chunk.start} is next: the ring broke FIFO order"
            )
        if chunk.is_branch:
            first = verdict.target_ids[:1]
            if tuple(first) != chunk.ids[1:2]:
                return Outcome(emitted=(), branch=True, lost=True)  # the next chunk decides
            self.drafts = list(chunk.draft)  # its guesses, where the main chunk's were
            self.qs = [None] * len(chunk.draft)
        emitted: list[int] = []
        rejected = False
        for offset, target in enumerate(verdict.target_ids, start=1):
            position = chunk.start + offset
            if position < len(self.committed):  # fed again: committed by an earlier verdict
                if target != self.committed[position]:
                    rejected = True  # two answers for one position: the ring is not
                    self.drafts.clear()  # deterministic; the committed one stands
                    self.qs.clear()
                    self.feed = len(self.committed) - 1
                    break
                continue
            guess = self.token(position)
            emitted.extend(self.decode.commit([target]))
            if guess is not None and guess != target:
                rejected = True
                self._correct(position, target)
                break
            self._advance(target)
            if self.decode.done:
                break
        if chunk.is_branch:
            # The main chunk ran after it at every stage (or is dropped there as stale): the
            # KV past the start is not the branch's.
            self.feed = min(self.feed, chunk.start + 1)
        bumped = None
        if (rejected or chunk.is_branch) and self.inflight:
            self.epoch = Epoch(self.epoch + 1)
            bumped = self.epoch
            self.inflight.clear()
        known = chunk.known
        return Outcome(
            emitted=tuple(emitted),
            rejected=rejected,
            bumped_epoch=bumped,
            drafted=len(chunk.draft) - known,
            accepted=max(0, verdict.accepted - known),
            known=known,
            branch=chunk.is_branch,
        )

    def resync(self) -> Epoch:
        """Forget the chunks in flight (lost with a failed node or link): the next chunk starts
        at the first position not yet verified, in a new epoch. Returns that epoch."""
        if self.inflight:
            self.feed = self.inflight[0].start
        self.inflight.clear()
        self.epoch = Epoch(self.epoch + 1)
        return self.epoch

    def _advance(self, target: int) -> None:
        """Commit ``target`` at the next position, consuming the draft there if any."""
        self.committed.append(target)
        if self.drafts:
            self.drafts.pop(0)
            self.qs.pop(0)

    def _correct(self, position: int, target: int) -> None:
        """The target disagreed at ``position``: commit its token, drop every draft."""
        assert position == len(self.committed)
        self.committed.append(target)
        self.drafts.clear()
        self.qs.clear()
        self.feed = position  # the corrected token is not in any stage's KV yet

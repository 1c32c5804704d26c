"""The tail's own drafts: a checkpoint's MTP block run at the tail, after the last layer
(``OpenSession.drafts``, ``Verdict.drafts``; docs/drafts.md, "MTP").

A session that opens with ``drafts = N > 0`` at a tail holding the block (``TailDrafts``)
gets, with each verdict, the block's chained guesses for the positions right after the
verdict's last committed id: ``N`` after the prompt, then as many as two more chunks of the
size just verified need (``TailSession.wanted``). The block reads what a coordinator's
``HeadProposer`` over the same block would read from ``Verdict.features``: the final-norm
rows of the committed positions in the wire's dtype (the tail's feature window computes
them, and they stay here), and the tokens those positions read — the prompt's from
``Prefill.tail_ids``, then the ids each verdict commits. So the tail's drafts are the ones
that coordinator would make, and only ids cross the return link: a few bytes a draft instead
of ``2 x hidden`` a committed row.

Rows whose tokens the tail never saw (no ``tail_ids``: it joined mid-prompt) get no drafts,
and the coordinator then sends plain steps until a verdict carries some. A verify chunk past
the tail's record of the stream (frames lost, a tail spliced in after a failure) restarts the
block at its first row, which reads only committed ids: its attention sees nothing before.
A chunk of an older epoch is dropped before it runs (``StageExecutor``); one that runs before
its epoch is known is overwritten, as every KV cache here is, by the chunk that replaces it.
A tail without the block (``TailDrafts`` not given) serves such sessions without drafts.
None of this changes a verdict's ids: drafts are guesses, checked by the next lap.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from shard.compute.tensors import from_wire
from shard.decode.head.model import HeadError
from shard.decode.head.mtp import MtpHead
from shard.decode.head.proposer import HeadProposer
from shard.messages import MAX_TAIL_DRAFTS, OpenSession, Prefill, Verdict, Verify

__all__ = ["TailDrafts", "TailSession", "drafts_refusal", "ids_refusal"]

_UNSEEN = -1  # a stream position whose token the tail never saw
_LEAST = 4  # drafts chained after any verify chunk (``TailSession.wanted``)


@attrs.define
class TailSession:
    """One session's drafting at the tail: the block's proposer, how many drafts a verdict
    carries, and the stream's tokens as the tail knows them (``_UNSEEN`` where it does not)."""

    proposer: HeadProposer
    count: int
    tokens: list[int] = attrs.field(factory=list)

    def prompt_chunk(self, msg: Prefill, rows: int) -> None:
        """Record a prompt chunk's ``tail_ids`` (its last ids, checked by ``ids_refusal``)."""
        end = msg.start + rows
        if len(self.tokens) < end:
            self.tokens.extend([_UNSEEN] * (end - len(self.tokens)))
        self.tokens[end - len(msg.tail_ids) : end] = msg.tail_ids

    def wanted(self, msg: Prefill | Verify) -> int:
        """How many drafts to chain after ``msg``'s verdict: the session's count after the
        prompt; after a verify chunk of ``k`` drafts, enough for two more chunks of its size
        and their bonus guesses, ``2 (k + 1)``, at least ``_LEAST`` — the coordinator's
        chunk size follows its own choice, and each step is one more of the block's forwards
        before the verdict leaves."""
        if isinstance(msg, Prefill):
            return self.count
        return min(self.count, max(_LEAST, 2 * (len(msg.draft) + 1)))

    def answer(
        self, msg: Prefill | Verify, verdict: Verdict, clock: Callable[[], float]
    ) -> Verdict:
        """``verdict`` as it leaves the tail: with its drafts, without the features they were
        drafted from (a worker thread's work: the block runs once a draft), its last hop sent
        now by ``clock`` (the drafting is time at the tail outside the forward's
        ``compute_s``)."""
        drafts = self.draft(msg, verdict)
        hops = verdict.hops
        if hops:
            hops = (*hops[:-1], attrs.evolve(hops[-1], sent_at=clock()))
        return attrs.evolve(verdict, features=None, features_start=0, drafts=drafts, hops=hops)

    def draft(self, msg: Prefill | Verify, verdict: Verdict) -> tuple[int, ...]:
        """The drafts after ``verdict`` (its features, if any, are the committed rows), or
        none when a row's token is not known here."""
        if verdict.features is None:
            return ()
        if isinstance(msg, Prefill):  # the prompt's length: its ids end there
            end = verdict.features_start + int(verdict.features.shape[0])
        else:  # its first id, the last committed: past what it saw, the block restarts here
            end = msg.start + 1
        self.tokens.extend([_UNSEEN] * (end - len(self.tokens)))
        del self.tokens[end:]
        self.tokens.extend(verdict.target_ids[: verdict.accepted + 1])
        first = verdict.features_start
        if _UNSEEN in self.tokens[first + 1 :]:
            return ()
        rows = from_wire(verdict.features).float()
        try:
            self.proposer.observe(first, rows)
            return tuple(self.proposer.propose(self.tokens, self.wanted(msg)))
        except HeadError:
            return ()  # positions past the session's length: nothing to guess


class TailDrafts:
    """A tail's MTP block (``MtpHead``, on the tail's device) and the sessions drafting with it."""

    def __init__(self, head: MtpHead) -> None:
        self.head = head

    @property
    def window(self) -> int:
        """Committed rows the block reads back at most (a prompt's last rows)."""
        return self.head.feature_window

    def open(self, msg: OpenSession) -> TailSession | None:
        """The session's drafting state (None when it asks for no drafts)."""
        if not msg.drafts:
            return None
        return TailSession(HeadProposer(self.head, max_len=msg.max_len), msg.drafts)


def drafts_refusal(msg: OpenSession) -> str | None:
    """Why a tail refuses the drafts ``msg`` asks for, or None. A tail with no MTP block
    (``TailDrafts``) refuses nothing for that: it serves the session and its verdicts carry
    no drafts (the coordinator then decodes plainly), as a tail whose block could not be
    loaded said in its log when it started."""
    if not 0 <= msg.drafts <= MAX_TAIL_DRAFTS:
        return f"drafts {msg.drafts} not in [0, {MAX_TAIL_DRAFTS}]"
    if msg.drafts and msg.features:
        return "a session asks for tail drafts or for features, not both"
    return None


def ids_refusal(msg: Prefill, rows: int, vocab: int) -> str | None:
    """Why a prompt chunk's ``tail_ids`` cannot be the last ids of its ``rows`` positions."""
    if len(msg.tail_ids) > rows:
        return f"{len(msg.tail_ids)} tail_ids in a chunk of {rows} positions"
    if any(not 0 <= t < vocab for t in msg.tail_ids):
        return f"a tail_id out of range [0, {vocab})"
    return None

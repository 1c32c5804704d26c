"""RequestDriver: one request's session through the ring, from prefill to the last token.

The router (``shard.coordinator.coordinator``) owns what requests share and starts one driver per
request, with its channels: the session's route (verdicts, faults and ``Resync`` in), the
``RingGate`` (messages out, towards stage 0) and the caller's ``tokens`` (one ``Committed`` per
batch of committed ids); ``run`` returns the request's ``Completion`` or raises the
``RingError`` that ended it, to the router awaiting it in the caller's task. The driver opens the
session, streams the prompt, then runs the speculative loop (``shard.decode.speculation``):
keep chunks in flight, fold verdicts into the stream, send committed tokens. When the ring
fails under it, it re-sends from its committed tokens in a new epoch (``Resync``): after a
splice or a re-dialled edge, after frames were lost (a stage's ``gap`` fault: from position
0), or after ``retry_after_s`` of silence. It never commits a token the target did not
choose, and it never loses one: a request that cannot go on ends with ``RingError`` carrying
what was committed.

What it records for statistics (laps, stale verdicts, K/D, events) goes to the ``Ledger`` by
direct call, and its K/D controller comes from there: synchronous local records, never a wait
(``shard.coordinator.ledger`` says why).

A proposer that reads the target's features (``Proposer.features`` > 0) opens the session with
that window; each verdict's features are checked (``shard.coordinator.features``) before it is
folded in, and the proposer observes those of every verdict that commits, before it next
proposes. Malformed features end the request with ``RingError`` (the verdict carrying them is
not folded in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import trio

from shard.coordinator.config import DriverShared, RequestPlan
from shard.coordinator.events import (
    CallerLeft,
    Committed,
    Completion,
    Resync,
    RingError,
    RouteEvent,
)
from shard.coordinator.features import FeatureError, verdict_features
from shard.coordinator.gate import RingDown
from shard.coordinator.ringstats import LapRecorder
from shard.decode.control import LOOKUP, SpeculationConfig, SpeculationController
from shard.decode.draft import Proposer
from shard.decode.hybrid import HybridProposer
from shard.decode.speculation import Chunk, Outcome, SpeculationStream
from shard.decode.tail import TailProposer
from shard.messages import (
    ChunkSeq,
    Epoch,
    Fault,
    OpenSession,
    Prefill,
    Truncate,
    Verdict,
    Verify,
)


class RequestDriver:
    """Drives one session (see the module docstring); ``run`` runs it to its end.

    The route stays open when the driver ends: the router reads the stages' receipts from it.

    Cancellation: cancelling ``run`` stops the request where it is (the router ends the
    session on the ring). Errors: the request's own failures (``RingError``, the ring lost)
    are raised from ``run`` holding the committed tokens; bugs propagate, and ``CallerLeft``
    when the caller closed its ``tokens`` channel.
    """

    def __init__(
        self,
        shared: DriverShared,
        request: RequestPlan,
        route: trio.MemoryReceiveChannel[RouteEvent],
        tokens: trio.MemorySendChannel[Committed] | None,
    ) -> None:
        """``tokens``: where committed ids go (the caller's channel; None: nowhere, the
        completion holds them all). Features must be ``shared.feature_dim`` wide (times the
        layers, for layer states; None: any)."""
        ledger, speculation, drafter = shared.ledger, request.speculation, shared.drafter
        self._ring = shared.ring
        self._ledger = ledger
        self._sid = request.sid
        self._route = route
        self._job = request.job
        self._prompt = request.prompt_ids
        self._state = request.state
        self._tokens = tokens
        self._checkpoint = request.checkpoint
        self._speculation = speculation
        self._limits = shared.limits
        self._drafter = drafter
        self._laps = LapRecorder(ledger.node, ledger.wall_clock)
        self._feature_dim = shared.feature_dim
        self._hold = shared.hold
        self._proposer: Proposer | None = None
        if drafter is not None and speculation.enabled:
            self._proposer = drafter.session(request.prompt_ids)
        job = request.job
        self._opening = OpenSession(
            session=request.sid,
            max_len=request.state.positions,  # the KV it can reach, not limits.max_len
            sampling=request.sampling,
            job=job.job if job else "",
            nonce=job.nonce if job else "",
            features=self._proposer.features if self._proposer is not None else 0,
            feature_layers=self._proposer.feature_layers if self._proposer is not None else (),
            drafts=self._proposer.tail_drafts if isinstance(self._proposer, TailProposer) else 0,
        )
        self._resyncs = 0
        self._patience = shared.limits.retry_after_s  # silence before a re-send; grows when slow
        self._silent_from: Epoch | None = None  # the epoch a re-send for silence left
        self._progress_at = trio.current_time()
        self._sources: dict[int, str] = {}  # the hybrid's: which draft guessed each position

    async def run(self) -> Completion:
        """Drive the request to its end. Errors: the ``RingError`` that ended it (a ring that
        went down too), holding the committed tokens."""
        if self._checkpoint is not None:
            self._checkpoint.begin()
        try:
            return await self._drive()
        except RingDown as exc:
            raise RingError(str(exc), committed=self._state.output) from None

    async def _emit(self, ids: Sequence[int], seq: int) -> None:
        if self._hold is not None:  # released only once confirmed; else the request ends
            await self._hold(
                self._sid, seq, self._state.output[: len(self._state.output) - len(ids)]
            )
        self._ledger.committed(len(ids))
        if not ids:
            return
        if self._checkpoint is not None:
            self._checkpoint.commit(ids)
        if self._tokens is not None:
            try:
                await self._tokens.send(Committed(tuple(int(t) for t in ids)))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise CallerLeft(f"session {self._sid}: the caller stopped reading") from None

    async def _drive(self) -> Completion:
        state, laps, ledger = self._state, self._laps, self._ledger
        first = await self._prefill()
        self._observe(self._features(first, prompt_len=len(self._prompt)))
        self._take_drafts(first, len(self._prompt) + 1)
        ledger.lap(laps, first, committed=len(first.target_ids))
        await self._emit(state.commit(first.target_ids), first.seq)
        stream = SpeculationStream(
            decode=state,
            committed=[*self._prompt, *first.target_ids],
            max_len=self._opening.max_len,
            feed=len(self._prompt),
            next_seq=first.seq + 1,
            epoch=first.epoch,
        )
        proposer = self._proposer
        control = ledger.control_for(
            self._speculation if proposer else SpeculationConfig(k=0, depth=1)
        )
        max_depth = 1
        while not state.done:
            max_depth = max(max_depth, await self._fill(stream, proposer, control))
            event = await self._next_event(stream.epoch)
            if isinstance(event, Resync):
                await self._resync(stream, event)
                continue
            outcome = await self._fold(stream, event)
            if outcome is None:
                continue
            control.observe_chunk(
                outcome.drafted,
                outcome.accepted,
                outcome.rejected,
                self._sources_of(event.start + outcome.known, outcome.drafted, outcome.branch),
            )
            control.observe_lap(laps.last_lap_s, max((h.compute_s for h in event.hops), default=0))
            if proposer is not None:
                proposer.feedback(outcome.drafted, outcome.accepted)
            await self._emit(outcome.emitted, event.seq)
        assert state.finish_reason is not None
        return Completion(
            token_ids=tuple(state.output),
            finish_reason=state.finish_reason,
            stats=laps.stats(len(state.output), max_depth=max_depth),
        )

    def _sources_of(self, start: int, drafted: int, branch: bool) -> list[str] | None:
        """Which draft guessed each of a verified chunk's ``drafted`` guesses (positions
        ``start + 1 ..``: the lookup's, for a branch), None unless all are known; forgets
        every position up to them."""
        span = range(start + 1, start + 1 + drafted)
        names = [self._sources[p] for p in span if p in self._sources]
        for p in [p for p in self._sources if p <= start + drafted]:
            del self._sources[p]
        if branch:
            return [LOOKUP] * drafted if drafted else None
        return names if drafted and len(names) == drafted else None

    async def _fold(self, stream: SpeculationStream, verdict: Verdict) -> Outcome | None:
        """Fold a verdict into the stream; None when it changed nothing (stale, duplicate,
        or out of order — which re-sends)."""
        ledger = self._ledger
        head = stream.inflight[0].seq if stream.inflight else None
        if verdict.epoch == stream.epoch and head is not None and verdict.seq != head:
            if verdict.seq < head:  # a duplicate of one already folded in
                ledger.stale()
                return None
            why = Resync(False, f"verdict {verdict.seq} arrived before {head}")
            await self._resync(stream, why)
            return None
        current = verdict.epoch == stream.epoch and head is not None
        features = self._features(verdict) if current else None
        outcome = stream.on_verdict(verdict)
        if outcome.stale:
            ledger.stale()
            self._laps.discard(verdict.seq)
            return None
        if outcome.lost:  # a branch whose first guess the target did not choose
            self._laps.computed(verdict.seq, verdict.hops)
            return None
        if outcome.branch:
            self._laps.branch(won=True)
        self._observe(features)
        self._take_drafts(verdict, len(stream.committed))
        ledger.lap(self._laps, verdict, committed=len(outcome.emitted), outcome=outcome)
        if outcome.bumped_epoch is not None:
            ledger.event("epoch", f"session {self._sid}: epoch {outcome.bumped_epoch}")
            await self._ring.send(
                Truncate(session=self._sid, epoch=outcome.bumped_epoch, position=stream.feed)
            )
        return outcome

    def _features(
        self, verdict: Verdict, *, prompt_len: int | None = None
    ) -> tuple[int, torch.Tensor] | None:
        """The verdict's checked features (``verdict_features``); malformed ones end the
        request (``RingError``, with the tokens committed before this verdict)."""
        window, layers = self._opening.features, len(self._opening.feature_layers)
        dim = None if self._feature_dim is None else self._feature_dim * max(layers, 1)
        try:
            return verdict_features(verdict, window=window, dim=dim, prompt_len=prompt_len)
        except FeatureError as exc:
            tail = verdict.hops[-1].node if verdict.hops else "the tail"
            detail = f"{tail}: features: {exc} (session {self._sid})"
            self._ledger.event("fault", detail)
            raise RingError(detail, committed=self._state.output) from None

    def _observe(self, features: tuple[int, torch.Tensor] | None) -> None:
        if features is not None and self._proposer is not None and self._drafter is not None:
            self._drafter.observe(self._proposer, *features)

    def _take_drafts(self, verdict: Verdict, end: int) -> None:
        """Hand a verdict's drafts to a ``TailProposer`` (a malformed guess is dropped and
        noted: drafts only guess, so the request goes on)."""
        proposer = self._proposer
        if not isinstance(proposer, TailProposer):
            if verdict.drafts:
                self._ledger.event("fault", f"session {self._sid}: drafts it did not ask for")
            return
        if (why := proposer.take(end, verdict.drafts)) is not None:
            self._ledger.event("fault", f"session {self._sid}: tail drafts dropped: {why}")

    async def _prefill(self) -> Verdict:
        """Open the session and stream the prompt in ``prefill_chunk`` pieces; only the last
        makes the tail answer. A failure before that answer re-sends it all in a new epoch."""
        sid, ring = self._sid, self._ring
        total, chunk = len(self._prompt), self._limits.prefill_chunk
        pieces = [(a, min(a + chunk, total)) for a in range(0, total, chunk)]
        if self._checkpoint is not None:  # a resumed run: its output as its decode steps
            pieces = self._checkpoint.pieces(total, chunk)
        epoch = Epoch(0)
        while True:
            await ring.send(self._opening)
            for seq, (start, end) in enumerate(pieces):
                ids = tuple(int(t) for t in self._prompt[start:end])
                final = end == total
                if final:
                    self._laps.sent(seq)
                msg = Prefill(
                    sid, epoch, ChunkSeq(seq), start, final, ids, tail_ids=self._tail(ids)
                )
                await ring.send(msg)
                if self._job is not None:
                    self._job.sent_chunk(epoch, seq, start, ids)
            while True:
                event = await self._next_event(epoch)
                if isinstance(event, Resync) or event.epoch == epoch:
                    break
                self._ledger.stale()
            if isinstance(event, Verdict):
                return event
            self._count(event.reason)
            epoch = Epoch(epoch + 1)
            self._ledger.event(
                "resync", f"session {sid}: prefill again in epoch {epoch}: {event.reason}"
            )
            await ring.send(Truncate(session=sid, epoch=epoch, position=0))

    async def _resync(self, stream: SpeculationStream, why: Resync) -> None:
        """Re-send from the committed tokens in a new epoch (``why.full``: from position 0,
        with the same chunk shapes as before, so every stage's KV comes out the same)."""
        self._count(why.reason)
        sid, ring = self._sid, self._ring
        epoch = stream.resync()
        self._ledger.event("resync", f"session {sid}: epoch {epoch}: {why.reason}")
        await ring.send(Truncate(session=sid, epoch=epoch, position=stream.feed))
        if not why.full:
            return
        chunks = [c for c in ring.chunks(sid) if c.start < stream.feed]
        await ring.send(self._opening)
        for c in chunks:
            seq = ChunkSeq(stream.next_seq)
            stream.next_seq += 1
            tail_ids = self._tail(c.ids)
            await ring.send(Prefill(sid, epoch, seq, c.start, False, c.ids, tail_ids=tail_ids))
            if self._job is not None:  # the stages' chains hash re-sent chunks too
                self._job.sent_chunk(epoch, seq, c.start, c.ids)

    def _tail(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """A prompt chunk's ``tail_ids``: its last ids where the tail drafts, else none."""
        return ids[-TailProposer.window :] if self._opening.drafts else ()

    async def _fill(
        self, stream: SpeculationStream, proposer: Proposer | None, control: SpeculationController
    ) -> int:
        """Draft and send chunks until ``depth`` are in flight; returns the depth reached."""
        sid = self._sid
        hybrid = proposer if isinstance(proposer, HybridProposer) else None
        lead = None  # how far the hybrid's lookup would copy now: priced apart from the model
        config = control.config
        if hybrid is not None:
            hybrid.settle(stream.committed, control.model_alpha)
        if hybrid is not None and (config.k is None or config.depth is None):
            lead = hybrid.lookup_span(stream.context(), config.depth_max * (config.k_max + 1))
        k, depth = control.choose(sessions=self._ledger.sessions, lead=lead)
        self._ledger.kd(k, depth)
        while stream.depth < depth:
            wanted = stream.drafts_wanted(k)
            if wanted and proposer is not None and self._drafter is not None:
                tokens, qs, seconds = await self._drafter.propose_for(
                    proposer, stream.context(), wanted, self._opening.sampling
                )
                names = list(hybrid.names) if hybrid is not None else None
                control.observe_draft(seconds, len(tokens), names)
                if names is not None and len(names) == len(tokens):
                    at = range(stream.length, stream.length + len(names))
                    self._sources.update(zip(at, names, strict=True))
                stream.add_drafts(tokens, qs)
            # a branch, beside a chunk with nothing in flight: a copy's span, not the head's K
            alone = not stream.inflight
            branch = hybrid.branch(stream.committed, config.k_max) if hybrid and alone else []
            chunk = stream.next_chunk(k, branch)
            if chunk is None:
                break
            if chunk.branch is not None:
                self._laps.branch()
                await self._send(chunk.branch)
            await self._send(chunk)
        if not stream.inflight:
            raise RuntimeError(f"session {sid}: nothing in flight and nothing to send")
        return stream.depth

    async def _send(self, chunk: Chunk) -> None:
        """Send a verify chunk towards stage 0 (its lap starts now)."""
        self._laps.sent(chunk.seq)
        c = chunk
        await self._ring.send(
            Verify(self._sid, c.epoch, c.seq, c.start, ids=c.ids, draft=c.draft, q=c.q)
        )
        if self._job is not None:
            self._job.sent_chunk(chunk.epoch, chunk.seq, chunk.start, chunk.ids)

    async def _next_event(self, epoch: Epoch) -> Verdict | Resync:
        """The next verdict for this request, or a reason to re-send (``Resync``).

        While the scheduler repairs the ring the request just waits (the scheduler's own
        deadlines end the wait). Otherwise no answer for ``retry_after_s`` re-sends (frames
        may have been lost), and none for ``verdict_timeout_s`` (measured from the last
        verdict, across re-sends) ends the request.

        A verdict of the epoch that re-send left behind shows it was premature: the ring is
        slow, not lossy. The request then waits twice as long before the next re-send (up to
        half of ``verdict_timeout_s``) and that re-send does not count against
        ``max_resyncs``. Without it a lap longer than ``retry_after_s`` (a loaded swarm after
        a takeover, the soak of issue 40) never answered: each re-send made the verdict about
        to arrive stale and added work.
        """
        limits, ledger, state = self._limits, self._ledger, self._state
        while True:
            quiet = trio.current_time() - self._progress_at
            slice_s = max(0.0, min(self._patience, limits.verdict_timeout_s - quiet))
            with trio.move_on_after(slice_s) as waited:
                msg = await self._route.receive()
            if waited.cancelled_caught:
                quiet = trio.current_time() - self._progress_at
                if self._ring.repairing:
                    self._progress_at = trio.current_time()  # the repair's deadlines bound it
                    continue
                if quiet < limits.verdict_timeout_s:
                    self._silent_from = epoch  # a verdict of it coming later: premature
                    return Resync(full=False, reason=f"no verdict for {quiet:g} s")
                detail = f"no answer from the ring for {quiet:g} s"
                ledger.event("fault", detail)
                raise RingError(
                    f"{detail}: a stage is stalled or a link is silently dead; "
                    "the request stops here with the tokens committed so far",
                    committed=state.output,
                )
            if isinstance(msg, Resync):
                return msg
            if isinstance(msg, Fault) and msg.kind == "gap" and msg.session is not None:
                if msg.epoch is not None and msg.epoch < epoch:
                    continue  # reported before the last re-send
                ledger.event("fault", f"{msg.node}: gap: {msg.detail}")
                return Resync(full=True, reason=f"{msg.node} lacks KV: {msg.detail}")
            if isinstance(msg, Fault):
                ledger.event(
                    "fault", f"{msg.node}: {msg.kind}: {msg.detail} (session {msg.session})"
                )
                raise RingError(f"{msg.node}: {msg.kind}: {msg.detail}", committed=state.output)
            if not isinstance(msg, Verdict):
                raise RingError(
                    f"unexpected {type(msg).__name__} mid-request", committed=state.output
                )
            if self._job is not None:
                self._job.received_verdict(
                    msg.epoch, msg.seq, msg.start, msg.target_ids, msg.accepted
                )
            if self._silent_from is not None and msg.epoch <= self._silent_from:
                self._silent_from = None  # that re-send was premature: the ring is slow
                self._patience = min(2 * self._patience, limits.verdict_timeout_s / 2)
                self._resyncs = max(0, self._resyncs - 1)
            self._progress_at = trio.current_time()
            return msg

    def _count(self, reason: str) -> None:
        """Count a re-send; past ``limits.max_resyncs`` the request fails."""
        self._resyncs += 1
        if self._resyncs > self._limits.max_resyncs:
            raise RingError(
                f"session {self._sid}: gave up after {self._limits.max_resyncs} re-sends "
                f"(last: {reason}); limits.max_resyncs allows more",
                committed=self._state.output,
            )

"""Choosing K (drafts per chunk) and D (chunks in flight) from what the ring measured.

``SpeculationController`` maximises the expected rate of committed tokens over (K, D): acceptance
modelled by run length (``RunLengths``: drafts on copy text hold in runs, not independently),
the lap, the draft's cost per token, the slowest stage's compute per chunk, the price of a
chunk that goes stale and the sessions sharing the stages. ``docs/speculation.md``,
"Choosing K and D", has the formulas. Pure and synchronous; tests drive it with numbers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import attrs

#: The name a hybrid draft gives the guesses its prompt lookup copied (``HybridProposer``).
LOOKUP = "ngram"


@attrs.frozen
class SpeculationConfig:
    """How much to speculate. ``k``/``depth`` fixed when set, else chosen adaptively
    (bounded by ``k_max``/``depth_max``). ``k = 0`` is plain decoding."""

    k: int | None = None
    depth: int | None = None
    k_max: int = 8
    depth_max: int = 4

    @property
    def enabled(self) -> bool:
        return self.k != 0


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens committed by a chunk of ``k`` i.i.d. drafts: (1 - α^(k+1)) / (1 - α)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def pipeline_rate(
    alpha: float, k: int, depth: int, *, lap_s: float, draft_s: float, stage_s: float
) -> float:
    """Expected tokens per second with ``depth`` chunks of ``k`` drafts in flight, with
    i.i.d. acceptance α.

    The chunks verify ``depth·(k+1) − 1`` guesses in sequence (a pipelined chunk's first id
    is a guess of the bonus token before it), so they commit ``expected_tokens(α,
    depth·(k+1) − 1)``; a cycle lasts one lap, or longer when drafting or the slowest stage
    cannot keep up with ``depth`` chunks per lap. ``draft_s`` is seconds per drafted token,
    ``stage_s`` the slowest stage's seconds per chunk.
    """
    useful = expected_tokens(alpha, depth * (k + 1) - 1)
    return useful / _cycle(k, depth, lap_s=lap_s, draft_s=draft_s, stage_s=stage_s)


def _cycle(
    k: int, depth: int, *, lap_s: float, draft_s: float, stage_s: float, sessions: int = 1
) -> float:
    """Seconds per pipeline cycle: a lap, or longer when drafting or the slowest stage cannot
    keep up with ``depth`` chunks per lap — from each of ``sessions`` sessions sharing it
    (assumed to pipeline alike: then the stage-bound choice is the efficient one)."""
    stage = max(sessions, 1) * stage_s
    return max(lap_s + k * draft_s, depth * max(stage, k * draft_s), 1e-9)


#: Observations of the shared run model a new session starts from (``SpeculationController.carry``).
SEED_EVIDENCE = 8.0

#: Run lengths that share a bucket: 0, 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-23, 24-31, 32+.
#: Long runs are rarer, so their buckets are wider: each still gathers evidence.
RUN_EDGES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@attrs.define
class RunLengths:
    """Acceptance as a function of the run so far: ``p(r)`` = P(the next guess holds | the
    last ``r`` guesses held), from counts shared by all of a coordinator's requests.

    Drafts do not fail independently. On copy text an n-gram draft is either inside a copied
    run — where almost every guess holds — or not; its overall α (0.68 on the benchmark's copy
    set) predicts 3.0 tokens per 6-token chunk where 5.3 were measured. Counting outcomes by
    run length captures that: ``expected`` and ``holds`` walk ``p`` from the current run.

    Runs are bucketed (``RUN_EDGES``). Counts decay (``decay`` per observed chunk) so the model
    follows a change of text. A bucket with little evidence leans on the pooled rate of all
    buckets: its estimate carries ``weight`` pseudo-observations of it (the pool itself
    starts from one pseudo-observation of ``prior``). A walk over many guesses multiplies
    these estimates, so a sparse bucket pinned at 1/2 would veto every deep pipeline that
    the pooled evidence supports.
    """

    prior: float = 0.5
    weight: float = 2.0
    decay: float = 0.998
    tried: list[float] = attrs.field(factory=lambda: [0.0] * len(RUN_EDGES))
    held: list[float] = attrs.field(factory=lambda: [0.0] * len(RUN_EDGES))

    @staticmethod
    def bucket(run: int) -> int:
        return bisect.bisect_right(RUN_EDGES, run) - 1

    def observe(self, run: int, drafted: int, accepted: int) -> None:
        """A chunk whose ``drafted`` guesses started at run length ``run``: the first
        ``accepted`` held, the next (if any) failed; later ones were never judged."""
        for i in range(len(RUN_EDGES)):
            self.tried[i] *= self.decay
            self.held[i] *= self.decay
        for j in range(min(drafted, accepted + 1)):
            b = self.bucket(run + j)
            self.tried[b] += 1.0
            if j < accepted:
                self.held[b] += 1.0

    def seeded(self, evidence: float) -> RunLengths:
        """A copy holding at most ``evidence`` observations, in the same proportions: a
        prior for one session that its own chunks soon outweigh."""
        total = sum(self.tried)
        scale = min(1.0, evidence / total) if total > 0 else 1.0
        return attrs.evolve(
            self, tried=[t * scale for t in self.tried], held=[h * scale for h in self.held]
        )

    def pooled(self) -> float:
        """Acceptance over every bucket."""
        return (sum(self.held) + self.prior) / (sum(self.tried) + 1.0)

    def p(self, run: int) -> float:
        return self._walk(run, 1)[0]

    def _walk(self, run: int, guesses: int) -> list[float]:
        """``p`` at runs ``run .. run + guesses - 1``."""
        lean = self.weight * self.pooled()
        return [
            (self.held[b] + lean) / (self.tried[b] + self.weight)
            for b in map(self.bucket, range(run, run + guesses))
        ]

    def holds(self, run: int, guesses: int) -> float:
        """P(the next ``guesses`` guesses all hold), from run length ``run``."""
        return math.prod(self._walk(run, guesses))

    def expected(self, run: int, guesses: int) -> float:
        """Expected tokens committed when ``guesses`` guesses are verified in sequence: the
        ones that hold, then the target's own token."""
        total, alive = 1.0, 1.0
        for p in self._walk(run, guesses):
            alive *= p
            total += alive
        return total


@attrs.define
class SpeculationController:
    """Chooses K and D per round from measured acceptance, lap time, draft and stage cost.

    With ``runs`` (a ``RunLengths``: after ``carry``, this request's own, seeded from the
    coordinator's ``shared`` one) acceptance is modelled by run length from this session's
    current run (``run``); without it, as i.i.d. with the EWMA ``alpha``. Timings are EWMAs;
    ``carry`` starts a request from the last one's.
    Starts from a prior (α = 0.5) so the first rounds speculate a little and measure.
    """

    config: SpeculationConfig
    alpha: float = 0.5
    lap_s: float = 0.05
    draft_s: float = 0.0
    stage_s: float = 0.0
    weight: float = 0.2
    runs: RunLengths | None = None
    run: int = 0
    shared: RunLengths | None = None
    #: The hybrid's two drafts, priced apart (``observe_chunk``/``observe_draft`` with
    #: ``sources``): the model's acceptance and seconds per drafted token, the lookup's cost.
    model_alpha: float = 0.5
    model_cost_s: float = 0.0
    lookup_cost_s: float = 0.0

    def carry(self, config: SpeculationConfig) -> SpeculationController:
        """A controller for the next request: the same timings, the run reset, and a run
        model of its own seeded from the shared one (``RunLengths.seeded``). Its chunks are
        counted in both: the session's model follows this request's text within a few
        chunks (prose after copy text stops pipelining), the shared one keeps the history."""
        shared = self.shared if self.shared is not None else self.runs
        if shared is None:
            return attrs.evolve(self, config=config, run=0)
        return attrs.evolve(
            self, config=config, run=0, runs=shared.seeded(SEED_EVIDENCE), shared=shared
        )

    def observe_chunk(
        self,
        drafted: int,
        accepted: int,
        rejected: bool = False,
        sources: Sequence[str] | None = None,
    ) -> None:
        """A verified chunk: ``drafted`` guesses, the first ``accepted`` held. ``sources``
        (the hybrid's): which draft made each guess, ``LOOKUP`` or the model. Then the run
        model counts only the chunk's leading lookup guesses (the copy spans it models)
        and the model's guesses that were judged update ``model_alpha``."""
        if drafted > 0:
            self.alpha += self.weight * (accepted / drafted - self.alpha)
            # every draft held but the target's next token differs from the guess a later
            # chunk in flight started with: that guess failed too
            bonus_failed = rejected and accepted == drafted
            tried = drafted + int(bonus_failed)
            if sources is not None and len(sources) == drafted:
                lead = next((i for i, s in enumerate(sources) if s != LOOKUP), drafted)
                tried = min(tried, lead) if lead < drafted else tried
                for j in range(lead, min(drafted, accepted + 1)):
                    if sources[j] != LOOKUP:
                        held = 1.0 if j < accepted else 0.0
                        self.model_alpha += self.weight * (held - self.model_alpha)
            if self.runs is not None and tried > 0:
                self.runs.observe(self.run, tried, accepted)
                if self.shared is not None:
                    self.shared.observe(self.run, tried, accepted)
            self.run = self.run + accepted if accepted == drafted and not rejected else 0
        elif rejected:
            self.run = 0

    def observe_lap(self, lap_s: float, stage_s: float) -> None:
        self.lap_s += self.weight * (lap_s - self.lap_s)
        self.stage_s += self.weight * (stage_s - self.stage_s)

    def observe_draft(
        self, seconds: float, tokens: int, sources: Sequence[str] | None = None
    ) -> None:
        """A proposal of ``tokens`` drafted tokens took ``seconds``; with ``sources`` the
        time is the model's tokens' (a lookup costs microseconds), or the lookup's when it
        made them all."""
        if tokens <= 0:
            return
        self.draft_s += self.weight * (seconds / tokens - self.draft_s)
        if sources is not None:
            made = sum(1 for s in sources if s != LOOKUP)
            if made:
                self.model_cost_s += self.weight * (seconds / made - self.model_cost_s)
            else:
                self.lookup_cost_s += self.weight * (seconds / tokens - self.lookup_cost_s)

    def _useful(self, k: int, d: int, lead: int | None = None) -> tuple[float, float]:
        """(expected tokens of ``d`` chunks of ``k`` drafts in flight, P(all but the last
        chunk's guesses hold)). A pipelined chunk's first id is a guess too (of the bonus
        token of the chunk before it). ``lead``: the hybrid's lookup span (``_priced``)."""
        guesses = d * (k + 1) - 1
        if lead is not None:
            ps = self._priced(guesses, lead)
            total, alive = 1.0, 1.0
            for p in ps:
                alive *= p
                total += alive
            return total, math.prod(ps[: (d - 1) * (k + 1)])
        if self.runs is None:
            return expected_tokens(self.alpha, guesses), self.alpha ** ((d - 1) * (k + 1))
        return (
            self.runs.expected(self.run, guesses),
            self.runs.holds(self.run, (d - 1) * (k + 1)),
        )

    def _priced(self, guesses: int, lead: int) -> list[float]:
        """P(hold) of each of ``guesses`` guesses in order when the lookup makes the first
        ``lead`` (its current span: the run model's walk from this run, or α without one)
        and the model the rest (``model_alpha``)."""
        n = min(lead, guesses)
        if self.runs is not None:
            copied = self.runs._walk(self.run, n) if n else []
        else:
            copied = [self.alpha] * n
        return [*copied, *[self.model_alpha] * (guesses - n)]

    def _draft_cost(self, k: int, d: int, lead: int | None) -> float:
        """Seconds per drafted token over ``d`` chunks of ``k``: ``draft_s``, or with the
        hybrid's ``lead`` each source's own price for the guesses it makes."""
        if lead is None:
            return self.draft_s
        guesses = d * (k + 1) - 1
        n = min(lead, guesses)
        return (n * self.lookup_cost_s + (guesses - n) * self.model_cost_s) / guesses

    def choose(self, sessions: int = 1, lead: int | None = None) -> tuple[int, int]:
        """(K, D) for the next chunk: fixed values win, the rest maximise the expected rate.

        ``lead`` (the hybrid): the lookup's span at the frontier now — it would copy the
        next ``lead`` guesses for free and the model would draft the rest — so each guess is
        priced by the draft that would make it (``_priced``, ``_draft_cost``): a long copy
        span pipelines deep at no draft cost, the model's short runs keep chunks short.

        ``sessions`` in flight share every stage: with many, the stages are the limit and
        chunks that may go stale take compute from the others, so pipelines stay shallow.

        A chunk put in flight behind others goes stale when a guess before it fails. Stages
        skip stale frames still queued, but the one a stage is computing when the verdict
        lands delays the re-drafted chunk behind it by up to one chunk's compute: each
        candidate's cycle carries that, ``P(a chunk in flight goes stale) x stage_s``. Deep
        pipelines are chosen when they pay after it, not by a fixed threshold on α.
        """
        ks = [self.config.k] if self.config.k is not None else range(1, self.config.k_max + 1)
        ds = (
            [self.config.depth]
            if self.config.depth is not None
            else range(1, self.config.depth_max + 1)
        )
        best, best_rate = (ks[0], ds[0]), -1.0
        for k in ks:
            for d in ds:
                useful, pays = self._useful(k, d, lead)
                cycle = _cycle(
                    k,
                    d,
                    lap_s=self.lap_s,
                    draft_s=self._draft_cost(k, d, lead),
                    stage_s=self.stage_s,
                    sessions=sessions,
                )
                rate = useful / (cycle + (1.0 - pays) * self.stage_s)
                if rate > best_rate:
                    best, best_rate = (k, d), rate
        return best

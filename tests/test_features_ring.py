"""Features on the return path, through the in-process ring: a proposer that asks for the
target's features observes exactly the reference model's final-norm output, at the right
stream positions, for the prompt and for verify chunks with accepted and rejected drafts,
alone and batched with a session that asks for none; greedy output stays the same."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import torch
import trio

from shard.coordinator.coordinator import Completion
from shard.decode.control import SpeculationConfig
from shard.decode.draft import Drafter, Proposer
from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint
from shard.testing.faults import FaultPlan
from test_failover import MAX_TOKENS as FAILOVER_TOKENS
from test_failover import PREFILL, failover_spec, run_scenario
from test_failover import PROMPTS as FAILOVER_PROMPTS
from test_speculation_ring import DEADLINE_S, reference, spec_for

WINDOW = 16  # >= K + 1: every committed row of every chunk comes back
MAX_TOKENS = 20
# Longer than the spec's prefill_chunk (8): the prompt crosses three chunks.
PROMPT = [5, 17, 99, 3, 5, 17, 99, 3, 40, 41, 42, 43, 44, 40, 41, 42, 7, 7, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("features"), seed=11, n_layers=4)


def reference_features(model_dir: Path, tokens: Sequence[int]) -> torch.Tensor:
    """The final norm's output at every position of ``tokens`` (fp32 ``[S, D]``), read off
    ``StageModel.norm`` by a hook while the whole model runs them in one process."""
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    assert model.norm is not None
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.inference_mode():
        model(torch.tensor([list(tokens)]), 0, model.new_cache(len(tokens)))
    hook.remove()
    return seen[0][0].float()  # [S, D]


class Recorder:
    """Drafts the reference continuation, spoiling every ``spoil``-th guess's last token (so
    some chunks are rejected after accepted drafts), and records the features it observes."""

    name = "recorder"
    computes = False

    def __init__(
        self,
        reference: Sequence[int],
        *,
        features: int,
        spoil: int = 3,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        self._reference = list(reference)
        self.features = features
        self.feature_layers = feature_layers
        self._spoil = spoil
        self._calls = 0
        self.observed: list[tuple[int, torch.Tensor]] = []

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        n = len(context)
        if list(context) != self._reference[:n]:
            return []
        guess = self._reference[n : n + k]
        self._calls += 1
        if guess and self._calls % self._spoil == 0:
            guess[-1] = (guess[-1] + 1) % 256
        return guess

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        self.observed.append((position, features.clone()))


def drafts(proposers: dict[tuple[int, ...], Proposer]) -> object:
    """A ``run_swarm`` drafter maker handing each prompt its proposer."""

    def make(_spec: SwarmSpec, _model_dir: Path) -> Drafter:
        return Drafter(lambda prompt: proposers[tuple(prompt)])

    return make


async def ring_run(
    spec: SwarmSpec,
    model_dir: Path,
    proposers: dict[tuple[int, ...], Proposer],
    speculation: SpeculationConfig,
) -> dict[tuple[int, ...], Completion]:
    """Every prompt of ``proposers`` at once through one ring; their completions."""
    done: dict[tuple[int, ...], Completion] = {}
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(
                    spec,
                    model_dir=model_dir,
                    drafts=drafts(proposers),  # type: ignore[arg-type]
                    task_status=task_status,
                )
            )

            async def one(prompt: tuple[int, ...]) -> None:
                done[prompt] = await handle.coordinator.generate(
                    list(prompt), max_tokens=MAX_TOKENS, speculation=speculation
                )

            async with trio.open_nursery() as clients:
                for prompt in proposers:
                    clients.start_soon(one, prompt)
            nursery.cancel_scope.cancel()
    return done


def check_observed(recorder: Recorder, want: torch.Tensor, prompt_len: int, end: int) -> None:
    """The first observation is the prompt's last ``WINDOW`` rows; then each verdict's rows
    follow on without a gap or overlap, up to the last committed input (``end - 1``), and
    every row equals the reference's (fp16 on the wire)."""
    first, rows = recorder.observed[0]
    window = min(WINDOW, prompt_len)
    assert (first, rows.shape[0]) == (prompt_len - window, window)
    at = first
    for position, rows in recorder.observed:
        assert position == at, f"features for {position} where {at} comes next"
        assert rows.dtype == torch.float32 and rows.shape[1] == want.shape[1]
        torch.testing.assert_close(rows, want[at : at + rows.shape[0]], rtol=1e-3, atol=1e-3)
        at += rows.shape[0]
    assert at >= end - 1  # the last chunk may have fed past the last committed input


@pytest.mark.parametrize("depth", [1, 2])
async def test_features_are_the_reference_final_norm_at_their_positions(
    tiny: Path, depth: int
) -> None:
    """A 3-stage ring, a prompt in three chunks, K = 3 drafts (some spoiled: rejections after
    accepted drafts; D = 2 also pipelines): the proposer observes the reference's final-norm
    output at every committed position, and the output is the one without features."""
    spec = spec_for(tiny, "ngram")
    ref = reference(tiny, PROMPT, MAX_TOKENS)
    whole = [*PROMPT, *ref.token_ids]
    recorder = Recorder(whole, features=WINDOW)
    plain = Recorder(whole, features=0)
    key = tuple(PROMPT)
    config = SpeculationConfig(k=3, depth=depth)
    with_features = (await ring_run(spec, tiny, {key: recorder}, config))[key]
    without = (await ring_run(spec, tiny, {key: plain}, config))[key]
    assert with_features.token_ids == without.token_ids == ref.token_ids
    stats = with_features.stats
    assert 0 < stats.accepted < stats.drafted  # accepted drafts, and rejections
    assert not plain.observed
    want = reference_features(tiny, whole)
    check_observed(recorder, want, len(PROMPT), len(whole))


async def batched_with_a_silent_session(
    tiny: Path, feature_layers: tuple[int, ...] = ()
) -> tuple[Recorder, list[int]]:
    """``PROMPT``'s session asking for features (``feature_layers``: layer states) and another
    asking for none, at once, their chunks sharing forwards (a gather window). Checks both get
    the reference output, that they shared a forward and that the silent one observed nothing;
    returns the asking recorder and its whole stream (prompt and output)."""
    spec = spec_for(tiny, "ngram")
    spec = attrs.evolve(spec, limits=attrs.evolve(spec.limits, gather_window_s=0.02))
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    refs = {tuple(p): reference(tiny, p, MAX_TOKENS) for p in (PROMPT, other)}
    whole = {p: [*p, *r.token_ids] for p, r in refs.items()}
    asking = Recorder(whole[tuple(PROMPT)], features=WINDOW, feature_layers=feature_layers)
    silent = Recorder(whole[tuple(other)], features=0)
    done = await ring_run(
        spec, tiny, {tuple(PROMPT): asking, tuple(other): silent}, SpeculationConfig(k=3, depth=1)
    )
    for prompt, ref in refs.items():
        assert done[prompt].token_ids == ref.token_ids
    rows = max(n.batch_rows for c in done.values() for n in c.stats.nodes)
    assert rows > 4, f"the sessions' chunks never shared a forward ({rows} rows)"
    assert not silent.observed
    return asking, whole[tuple(PROMPT)]


async def test_a_batch_of_a_session_with_features_and_one_without(tiny: Path) -> None:
    """Two sessions at once whose chunks share forwards (a gather window): the one that asks
    gets the reference features, the other none; both get the reference output."""
    asking, whole = await batched_with_a_silent_session(tiny)
    check_observed(asking, reference_features(tiny, whole), len(PROMPT), len(whole))


async def test_plain_decoding_with_features_gets_one_row_per_step(tiny: Path) -> None:
    """A proposer that never guesses (every chunk one position): one row per verdict, each
    the reference's, and the reference output."""
    spec = spec_for(tiny, "ngram")
    ref = reference(tiny, PROMPT, MAX_TOKENS)
    whole = [*PROMPT, *ref.token_ids]
    recorder = Recorder([], features=WINDOW)  # matches no context: no drafts
    key = tuple(PROMPT)
    done = (await ring_run(spec, tiny, {key: recorder}, SpeculationConfig(k=3, depth=1)))[key]
    assert done.token_ids == ref.token_ids
    assert [r.shape[0] for _, r in recorder.observed[1:]] == [1] * (MAX_TOKENS - 1)
    check_observed(recorder, reference_features(tiny, whole), len(PROMPT), len(whole))


# Frames the tail sends once decoding is under way (one verdict per prompt, then one per
# chunk): good drafts make fewer chunks than test_failover's plain decoding, so its DECODE
# window (frames 14-40) would often not be reached. Upstream senders send 10 frames of
# openings and prompt chunks first, so DECODE is decoding for them.
TAIL_DECODE = (5, 12)
DECODE = (14, 20)


@pytest.fixture(scope="module")
def failover_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("failover"), seed=11, n_layers=6)


@pytest.mark.parametrize(
    ("kind", "node", "frames"),
    [
        ("kill", "s2", TAIL_DECODE),  # the tail: a standby takes its block and sessions
        ("kill", "s2", PREFILL),
        ("kill", "s1", DECODE),
        ("drop", "coord", DECODE),  # a lost chunk: a gap, a re-send from position 0
        ("sever", "s2", TAIL_DECODE),  # the return link re-dialled
        ("duplicate", "s2", TAIL_DECODE),  # a verdict twice
    ],
    ids=lambda v: v if isinstance(v, str) else ("prefill" if v == PREFILL else "decode"),
)
def test_features_survive_failover(
    failover_model: Path, kind: str, node: str, frames: tuple[int, int]
) -> None:
    """Three requests with features through a fault (virtual time, test_failover's swarm and
    standbys): every output is the reference's, and each proposer still observes the
    reference's features at every committed position, once, in order."""
    config = ModelConfig.from_dir(failover_model)
    whole = load_stage(failover_model, 0, config.n_layers)
    wholes = {}
    for p in FAILOVER_PROMPTS:
        out = generate_reference(
            whole,
            list(p),
            eos_ids=config.eos_token_ids,
            max_tokens=FAILOVER_TOKENS,
            prefill_chunk=4,
            max_len=96,
        )
        wholes[tuple(p)] = [*p, *out.token_ids]
    recorders = {p: Recorder(w, features=WINDOW) for p, w in wholes.items()}
    plan = FaultPlan.random(77, kind=kind, node=node, frames=frames)
    spec = failover_spec(failover_model, speculate=True)
    out = run_scenario(spec, failover_model, plan, drafts=drafts(recorders))  # type: ignore[arg-type]
    assert out.injector.fired, f"{plan}: the fault never fired"
    kinds = [(r.kind, r.lost) for r in out.recoveries]
    if kind == "kill":
        assert ("hot", node) in kinds, f"{plan}: {out.recoveries}"
    elif kind == "sever":
        assert ("relink", node) in kinds, f"{plan}: {out.recoveries}"
    elif kind == "drop":
        assert any(e.startswith("resync") for e in out.events), f"{plan}: {out.events}"
    for result, (prompt, ids) in zip(out.results, wholes.items(), strict=True):
        assert isinstance(result, Completion), f"{plan}: {result}"
        assert [*prompt, *result.token_ids] == ids, f"{plan}: output differs"
        want = reference_features(failover_model, ids)
        check_observed(recorders[prompt], want, len(prompt), len(ids))

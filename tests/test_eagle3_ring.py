"""EAGLE-3 layer states through the in-process ring (issue 39, point 2): a session that asks
for the states entering some target layers (``OpenSession.feature_layers``) gets exactly the
reference model's states at every committed position, whichever stages hold those layers,
alone and batched with a session that asks for none; a swarm whose spec drafts with an
EAGLE-3 head (``draft = "eagle3"``) gives the plain output; and a stage refuses layer states
that do not fit its session with a typed fault, never a crash.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from shard.cli.errors import operator_errors
from shard.compute.tensors import to_wire
from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.head.eagle3_check import target_states
from shard.decode.head.eagle3_files import Eagle3Error
from shard.decode.hybrid import HybridProposer
from shard.messages import (
    MAX_FEATURE_LAYERS,
    ChunkSeq,
    Epoch,
    NodeName,
    OpenSession,
    SessionId,
    Verify,
)
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.drafter import make_drafter
from shard.spec.swarm import SwarmSpec
from shard.spec.validate import SpecError
from shard.stage.batch import Carried, Planned, forward_batch
from shard.stage.chunks import Session, StageFailed, features_refusal, plan
from shard.stage.graphs import ChunkGraphs
from shard.testing import make_tiny_checkpoint
from shard.testing.eagle3 import eagle3_config, write_eagle3_head
from test_features_ring import (
    MAX_TOKENS,
    PROMPT,
    WINDOW,
    Recorder,
    batched_with_a_silent_session,
    check_observed,
    ring_run,
)
from test_speculation_ring import reference, spec_for, with_ring
from test_stage_graphs import FakeCapture

N_LAYERS = 4  # spec_for's ring: [0, 1) [1, 3) [3, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("eagle3ring"), seed=11, n_layers=N_LAYERS)


def reference_states(model_dir: Path, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The residual stream entering each of ``layers`` at every position of ``tokens``, side by
    side (fp32 ``[S, len x D]``), from the whole model in one process."""
    model = load_stage(model_dir, 0, ModelConfig.from_dir(model_dir).n_layers)
    with torch.inference_mode():
        states, _ = target_states(model, torch.tensor(tokens), layers)
    return states.float()


# (0, 2, 3): one layer on each stage, the first one's state the embedding's output;
# (1, 2): both on the middle stage, the first stage carries nothing and the tail only relays.
@pytest.mark.parametrize("layers", [(0, 2, 3), (1, 2)], ids=["each-stage", "middle-only"])
async def test_layer_states_are_the_reference_at_their_positions(
    tiny: Path, layers: tuple[int, ...]
) -> None:
    """A 3-stage ring, a prompt in three chunks, K = 3 drafts (some spoiled, so chunks are
    rejected after accepted drafts), two chunks in flight: the proposer observes the
    reference's states entering ``layers`` at every committed position, and the output is
    the plain one."""
    spec = spec_for(tiny, "ngram")
    ref = reference(tiny, PROMPT, MAX_TOKENS)
    whole = [*PROMPT, *ref.token_ids]
    recorder = Recorder(whole, features=WINDOW, feature_layers=layers)
    key = tuple(PROMPT)
    done = (await ring_run(spec, tiny, {key: recorder}, SpeculationConfig(k=3, depth=2)))[key]
    assert done.token_ids == ref.token_ids
    assert 0 < done.stats.accepted < done.stats.drafted
    check_observed(recorder, reference_states(tiny, whole, layers), len(PROMPT), len(whole))


async def test_a_batch_of_a_session_with_layer_states_and_one_without(tiny: Path) -> None:
    """Two sessions whose chunks share forwards (a gather window): the one that asks gets the
    reference states, the other none; both get the reference output."""
    asking, whole = await batched_with_a_silent_session(tiny, (0, 2, 3))
    check_observed(asking, reference_states(tiny, whole, (0, 2, 3)), len(PROMPT), len(whole))


def eagle3_head(tiny: Path, path: Path, layer_ids: list[int]) -> Path:
    """A random EAGLE-3 head for ``tiny`` in the published layout, without ``embed_tokens``
    (the coordinator must read the target's)."""
    c = ModelConfig.from_dir(tiny)
    config = eagle3_config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,  # its embedding is the target's
        draft_vocab_size=c.vocab_size // 2,
        target_hidden_size=c.hidden_size,
        layer_ids=layer_ids,
    )
    return write_eagle3_head(path, config, seed=3, with_embedding=False)


async def swarm_run(
    tiny: Path, head: Path, speculation: SpeculationConfig, draft: str = "eagle3"
) -> Completion:
    """``PROMPT`` through a 3-stage ring whose spec drafts with the EAGLE-3 head ``head``
    (``draft`` "hybrid": the n-gram over long matches, the head elsewhere)."""
    spec = spec_for(tiny, "ngram")
    plan_ = attrs.evolve(spec.speculation, draft=draft, draft_head=str(head))
    spec = attrs.evolve(spec, speculation=plan_)

    async def body(coordinator: Coordinator) -> Completion:
        prompt = list(PROMPT)
        return await coordinator.generate(prompt, max_tokens=MAX_TOKENS, speculation=speculation)

    done: Completion = await with_ring(spec, tiny, body)
    return done


@pytest.mark.parametrize(("draft", "depth"), [("eagle3", 1), ("eagle3", 2), ("hybrid", 2)])
async def test_a_swarm_drafting_with_an_eagle3_head_gives_the_plain_output(
    tiny: Path, tmp_path: Path, draft: str, depth: int
) -> None:
    """``draft = "eagle3"`` (or ``"hybrid"`` naming an EAGLE-3 head) with a head of layers
    (0, 2, 3) and no ``embed_tokens``: the coordinator loads it with the target's embedding,
    the ring returns those layers' states, and greedy speculation with it gives exactly the
    reference output."""
    head = eagle3_head(tiny, tmp_path / "head", [0, 2, 3])
    done = await swarm_run(tiny, head, SpeculationConfig(k=3, depth=depth), draft)
    assert done.token_ids == reference(tiny, PROMPT, MAX_TOKENS).token_ids
    assert done.stats.drafted > 0


async def test_the_hybrid_is_told_what_is_settled_before_each_proposal(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver hands the hybrid the committed tokens (the prompt, then the verified
    output: never a draft in flight) and the controller's model acceptance before drafting."""
    seen: list[tuple[list[int], float]] = []
    settle = HybridProposer.settle

    def spy(self: HybridProposer, committed: list[int], model_alpha: float) -> None:
        seen.append((list(committed), model_alpha))
        settle(self, committed, model_alpha)

    monkeypatch.setattr(HybridProposer, "settle", spy)
    head = eagle3_head(tiny, tmp_path / "head", [0, 2, 3])
    done = await swarm_run(tiny, head, SpeculationConfig(k=3, depth=2), "hybrid")
    stream = [*PROMPT, *done.token_ids]
    assert len(seen) > 1
    assert seen[0][0][: len(PROMPT)] == list(PROMPT)
    for committed, alpha in seen:
        assert committed == stream[: len(committed)]
        assert 0.0 <= alpha <= 1.0
    assert [len(c) for c, _ in seen] == sorted(len(c) for c, _ in seen)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("right", [True, False], ids=["branch-right", "branch-wrong"])
async def test_branches_beside_the_chunks_keep_the_plain_output(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, right: bool, depth: int
) -> None:
    """A branch beside every chunk that starts at the last committed token (``branch``
    scripted: the reference's next tokens, or a wrong first guess): with the layer states
    travelling, right branches are committed and their tokens fed again, wrong ones change
    nothing, and the output is the plain one either way."""
    ref = reference(tiny, PROMPT, MAX_TOKENS).token_ids
    whole = [*PROMPT, *ref]
    vocab = ModelConfig.from_dir(tiny).vocab_size

    def scripted(self: HybridProposer, committed: list[int], k: int) -> list[int]:
        assert committed == whole[: len(committed)]  # never a draft: committed tokens only
        nxt = whole[len(committed) : len(committed) + k]
        return nxt if right or not nxt else [(nxt[0] + 1) % vocab, *nxt[1:]]

    monkeypatch.setattr(HybridProposer, "branch", scripted)
    head = eagle3_head(tiny, tmp_path / "head", [0, 2, 3])
    done = await swarm_run(tiny, head, SpeculationConfig(k=3, depth=depth), "hybrid")
    assert done.token_ids == ref
    assert done.stats.branches > 0
    if right:
        assert done.stats.branches_won > 0
        assert done.stats.tokens_per_lap > 1.0
    else:
        assert done.stats.branches_won == 0


def test_a_spec_names_an_eagle3_heads_directory(tiny: Path, tmp_path: Path) -> None:
    """``draft = "eagle3"`` needs ``draft_head`` naming a directory (relative to the spec);
    without one, or with a file or a missing path, the spec is refused naming the key."""
    head = eagle3_head(tiny, tmp_path / "head", [0, 2, 3])
    base = {
        "swarm": {"name": "e3", "model": str(tiny), "insecure": True},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "stage": [{"name": "s0", "listen": "127.0.0.1:9101", "layers": [0, N_LAYERS]}],
        "limits": {"max_len": 256},  # within the tiny head's 512 positions
    }
    ok = SwarmSpec.from_dict(
        {**base, "speculation": {"draft": "eagle3", "draft_head": "head"}},
        source=str(tmp_path / "spec.toml"),
        base_dir=tmp_path,
    )
    assert ok.speculation.draft_head == str(head.resolve())
    hybrid = SwarmSpec.from_dict(
        {**base, "speculation": {"draft": "hybrid", "draft_head": "head"}},
        source=str(tmp_path / "spec.toml"),
        base_dir=tmp_path,
    )
    assert hybrid.speculation.draft_head == str(head.resolve())
    drafter = make_drafter(hybrid, tiny)  # the hybrid over the EAGLE-3 head, not a trained head
    assert drafter is not None
    proposer = drafter.session([1, 2, 3])
    assert isinstance(proposer, HybridProposer)
    assert proposer.feature_layers == (0, 2, 3)
    for table, why in [
        ({"draft": "eagle3"}, "draft_head"),
        ({"draft": "eagle3", "draft_head": "nowhere"}, "not an EAGLE-3 head directory"),
        ({"draft": "eagle3", "draft_head": "head/config.json"}, "not an EAGLE-3 head directory"),
        ({"draft": "eagle3", "draft_head": "head", "branch": False}, "branch"),
        ({"draft": "hybrid", "draft_head": "head", "branch": "no"}, "branch"),
    ]:
        with pytest.raises(SpecError, match=why):
            SwarmSpec.from_dict({**base, "speculation": table}, base_dir=tmp_path)
    assert hybrid.speculation.branch  # branches by default; off on request:
    off = {"draft": "hybrid", "draft_head": "head", "branch": False}
    chain = SwarmSpec.from_dict({**base, "speculation": off}, base_dir=tmp_path)
    drafter = make_drafter(chain, tiny)
    assert drafter is not None
    chained = drafter.session([1, 2, 3])
    assert isinstance(chained, HybridProposer)
    assert chained.branch([9, 4, 5, 6, 9], 3) == [] and proposer.branch([9, 4, 5, 6, 9], 3) == [
        4,
        5,
        6,
    ]


def test_a_head_for_another_model_is_refused_before_the_swarm_starts(
    tiny: Path, tmp_path: Path
) -> None:
    """A head of another vocabulary, or declaring a layer the target lacks: ``make_drafter``
    raises ``Eagle3Error`` naming why (the CLI reports it in one line)."""
    c = ModelConfig.from_dir(tiny)
    spec = spec_for(tiny, "ngram")
    heads = {
        "vocab_size": eagle3_config(
            vocab_size=c.vocab_size + 1,
            hidden_size=c.hidden_size,
            draft_vocab_size=c.vocab_size // 2,
            layer_ids=[0, 2, 3],
        ),
        f"of {N_LAYERS} layers": eagle3_config(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            draft_vocab_size=c.vocab_size // 2,
            layer_ids=[0, 2, N_LAYERS],
        ),
    }
    for why, config in heads.items():
        path = write_eagle3_head(tmp_path / why.replace(" ", "-"), config, seed=3)
        plan_ = attrs.evolve(spec.speculation, draft="eagle3", draft_head=str(path))
        with pytest.raises(Eagle3Error, match=why):
            make_drafter(attrs.evolve(spec, speculation=plan_), tiny)
    assert Eagle3Error in operator_errors()


# -- refusals: an OpenSession's layers, a chunk's states ---------------------------------------


@pytest.mark.parametrize(
    ("features", "layers", "why"),
    [
        (0, (1,), "without features"),
        (4, (2, 1), "strictly increasing"),
        (4, (1, 1), "strictly increasing"),
        (4, (0, N_LAYERS), "strictly increasing"),
        (4, (-1, 2), "strictly increasing"),
        (4, tuple(range(MAX_FEATURE_LAYERS + 1)), "strictly increasing"),
    ],
)
def test_an_open_session_with_layers_it_cannot_have_is_refused(
    tiny: Path, features: int, layers: tuple[int, ...], why: str
) -> None:
    model = load_stage(tiny, 1, 3)
    msg = OpenSession(SessionId(1), 16, features=features, feature_layers=layers)
    refusal = features_refusal(model, msg)
    assert refusal is not None and why in refusal
    assert features_refusal(model, attrs.evolve(msg, features=4, feature_layers=(0, 2))) is None


def test_a_chunk_whose_states_do_not_fit_its_session_fails_alone(tiny: Path) -> None:
    """A middle stage [1, 3) of a session capturing (0, 2, 3): a verify chunk must bring the
    layer 0 rows ``[1, rows, D]`` in the wire dtype; missing, unasked, misshapen or another
    dtype is a ``StageFailed`` for that chunk (a ``chunk`` fault), never a crash."""
    model = load_stage(tiny, 1, 3)
    d = model.config.hidden_size
    node = NodeName("s1")
    opening = OpenSession(SessionId(1), 16, features=4, feature_layers=(0, 2, 3))
    hidden = to_wire(torch.zeros(1, 2, d))
    chunk = Verify(SessionId(1), Epoch(0), ChunkSeq(0), 0, hidden=hidden, draft=(5,))

    def planned(msg: Verify, session: OpenSession = opening) -> object:
        sessions = {SessionId(1): Session.opened(session, model.new_cache(16), tail=False, now=0)}
        return plan(model, node, sessions, msg, 0.0)

    good = to_wire(torch.ones(1, 2, d, dtype=torch.float16))
    ok = planned(attrs.evolve(chunk, states=good))
    assert getattr(ok, "layers", None) == (1,) and getattr(ok, "carry", None) == 2
    bad = {
        "missing": None,
        "too wide": to_wire(torch.ones(1, 2, 2 * d, dtype=torch.float16)),
        "too few rows": to_wire(torch.ones(1, 1, d, dtype=torch.float16)),
        "float32": to_wire(torch.ones(1, 2, d)),
        "not a tensor": attrs.evolve(good, data=b"\0" * 3),
    }
    for what, states in bad.items():
        with pytest.raises(StageFailed, match="layer states") as caught:
            planned(attrs.evolve(chunk, states=states))
        assert caught.value.kind == "chunk", what
    with pytest.raises(StageFailed, match="asked for none"):
        planned(attrs.evolve(chunk, states=good), OpenSession(SessionId(1), 16))


def test_a_stage_with_graphs_runs_a_chunk_with_layer_states_eagerly(tiny: Path) -> None:
    """A middle stage with graphs on (a CPU stand-in capturer, as ``test_stage_graphs``): a
    verify chunk of a session capturing layer 2 runs eagerly with the graph's arithmetic (no
    capture: a replay runs no hook), its hidden states equal the graphed chunk's bit for bit,
    and its states are layer 0's rows that arrived followed by the rows entering layer 2."""

    model = load_stage(tiny, 1, 3)
    d, rows = model.config.hidden_size, 4
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="lazy", rows={rows}, capture=fake)
    x = torch.randn(1, rows, d, generator=torch.Generator().manual_seed(5))
    upstream = torch.randn(rows, d, generator=torch.Generator().manual_seed(6)).half()
    msg = Verify(SessionId(1), Epoch(0), ChunkSeq(0), 0, hidden=to_wire(x), draft=(1, 2, 3))
    sampling = OpenSession(SessionId(1), 16).sampling
    captured = Planned(
        msg, x, model.new_cache(16), sampling, 0.0, layers=(1,), carry=rows, states=upstream
    )
    (out,) = forward_batch(model, graphs, [captured])
    assert fake.captures == 0 and graphs.statistics().eager == 1
    plain = Planned(msg, x, model.new_cache(16), sampling, 0.0)
    (want,) = forward_batch(model, graphs, [plain])
    assert fake.captures == 1
    assert isinstance(out, Carried) and isinstance(want, torch.Tensor)
    assert torch.equal(out.hidden, want)
    layer_1 = load_stage(tiny, 1, 2)  # its output is what enters layer 2, at graph arithmetic
    entering = layer_1.forward_at(x, torch.arange(rows), layer_1.new_cache(16))
    assert out.states is not None and out.states.shape == (rows, 2 * d)
    assert torch.equal(out.states[:, :d], upstream)
    assert torch.equal(out.states[:, d:], entering[0].half())

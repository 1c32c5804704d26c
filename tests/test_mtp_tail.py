"""The MTP block at the tail (``shard.stage.tail_drafts``) and the coordinator's side of its
drafts (``shard.decode.tail.TailProposer``): what a tail answers, what it refuses, and what
the coordinator keeps of a peer's guesses. The ring runs are in ``test_mtp``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import trio

import family_fixtures
from shard.compute.offload import inline_compute
from shard.compute.tensors import from_wire
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.draft import Drafter, NGramProposer, Proposer
from shard.decode.head.mtp import MtpHead
from shard.decode.head.proposer import HeadProposer
from shard.decode.tail import TailProposer, tail_draft_count
from shard.messages import (
    MAX_TAIL_DRAFTS,
    ChunkSeq,
    Epoch,
    Fault,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Verdict,
    Verify,
)
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.spec.limits import Limits
from shard.stage.config import ExecutorConfig, StageAides
from shard.stage.executor import StageExecutor
from shard.stage.tail_drafts import TailDrafts
from test_mtp import with_mtp_block

pytest.importorskip("transformers")
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = (5, 77, 101, 60, 33, 8, 99, 42, 42, 7, 3, 5, 77, 101)
E0 = Epoch(0)


@pytest.fixture(scope="module")
def held(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Tiny GLM-4.5 with an MTP block in the published layout (``test_mtp``)."""
    return with_mtp_block(family_checkpoint("glm4_moe"), tmp_path_factory.mktemp("mtp") / "m")


async def whole_model(model_dir: Path, msgs: list[Message], *, block: bool = True) -> list[Message]:
    """What a whole-model stage (first and tail at once) sends for ``msgs``, drafting with
    the checkpoint's MTP block (``block``) or holding none."""
    n = ModelConfig.from_dir(model_dir).n_layers
    model = load_stage(model_dir, 0, n, dtype=torch.float32)
    drafts = TailDrafts(MtpHead.load(model_dir)) if block else None
    inbox_send, inbox_recv = trio.open_memory_channel[Message](0)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](len(msgs) + 1)
    config = ExecutorConfig(NodeName("s"), max_len=64)
    executor = StageExecutor(
        model, config, inbox_recv, outbox_send, aides=StageAides(drafts=drafts)
    )
    with inline_compute(), trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.run)
            async with inbox_send:
                for msg in msgs:
                    await inbox_send.send(msg)
    async with outbox_recv:
        return [msg async for msg in outbox_recv]


def prefill(sid: int, **kw: object) -> Prefill:
    return Prefill(SessionId(sid), E0, ChunkSeq(0), 0, True, PROMPT, **kw)  # type: ignore[arg-type]


async def test_a_tail_drafts_what_its_block_drafts_from_the_same_rows(held: Path) -> None:
    """A session opened with ``drafts = 4`` gets, with its prompt's verdict and a verify's,
    four ids and no features: exactly what a ``HeadProposer`` over the same block drafts from
    the rows and ids the same tail returns to a session that asks for features."""
    asked = [OpenSession(SessionId(1), max_len=64, drafts=4), prefill(1, tail_ids=PROMPT)]
    seen = [OpenSession(SessionId(2), max_len=64, features=64), prefill(2)]
    out = await whole_model(held, [*asked, *seen])
    mine, theirs = out
    assert isinstance(mine, Verdict) and isinstance(theirs, Verdict), out
    assert mine.features is None and len(mine.drafts) == 4 and theirs.features is not None
    proposer = HeadProposer(MtpHead.load(held), max_len=64)
    proposer.observe(theirs.features_start, from_wire(theirs.features).float())
    context = [*PROMPT, *mine.target_ids]
    assert list(mine.drafts) == proposer.propose(context, 4)

    chunk = (mine.target_ids[0], *mine.drafts[:2])
    verify = Verify(SessionId(1), E0, ChunkSeq(1), len(PROMPT), ids=chunk, draft=chunk[1:])
    seen_verify = Verify(SessionId(2), E0, ChunkSeq(1), len(PROMPT), ids=chunk, draft=chunk[1:])
    out = await whole_model(held, [*asked, verify, *seen, seen_verify])
    mine, theirs = out[1], out[3]
    assert isinstance(mine, Verdict) and isinstance(theirs, Verdict) and mine.drafts
    assert theirs.features is not None
    proposer.observe(theirs.features_start, from_wire(theirs.features).float())
    committed = [*PROMPT, chunk[0], *mine.target_ids[: mine.accepted + 1]]
    assert list(mine.drafts) == proposer.propose(committed, 4)


async def test_hostile_asks_are_refused_and_the_tail_serves_on(held: Path) -> None:
    """Too many drafts, drafts with features, ``tail_ids`` longer than the chunk or outside
    the vocabulary: each a fault for its own session; a good session after them is served."""
    vocab = ModelConfig.from_dir(held).vocab_size
    msgs: list[Message] = [
        OpenSession(SessionId(1), max_len=64, drafts=MAX_TAIL_DRAFTS + 1),
        OpenSession(SessionId(2), max_len=64, drafts=4, features=8),
        OpenSession(SessionId(3), max_len=64, drafts=4),
        prefill(3, tail_ids=(*PROMPT, 1)),
        OpenSession(SessionId(4), max_len=64, drafts=4),
        prefill(4, tail_ids=(vocab,)),
        OpenSession(SessionId(5), max_len=64, drafts=4),
        prefill(5, tail_ids=PROMPT),
    ]
    out = await whole_model(held, msgs)
    faults = [(m.session, m.kind) for m in out if isinstance(m, Fault)]
    assert faults == [(1, "request"), (2, "request"), (3, "chunk"), (4, "chunk")]
    details = " ".join(m.detail for m in out if isinstance(m, Fault))
    for why in ("not in [0, 32]", "not both", "tail_ids in a chunk of", "out of range"):
        assert why in details
    last = out[-1]
    assert isinstance(last, Verdict) and last.session == 5 and len(last.drafts) == 4


async def test_a_tail_without_the_block_answers_without_drafts(held: Path) -> None:
    out = await whole_model(
        held, [OpenSession(SessionId(1), max_len=64, drafts=4), prefill(1)], block=False
    )
    assert len(out) == 1 and isinstance(out[0], Verdict)
    assert out[0].drafts == () and out[0].features is None


async def test_a_tail_that_never_saw_the_prompt_ids_restarts_at_the_next_verify(
    held: Path,
) -> None:
    """Without ``tail_ids`` the block has no tokens for the prompt's rows: no drafts with the
    prompt's verdict. The next verify's rows read only ids the tail committed itself: the
    block restarts there, and that verdict carries drafts."""
    sid = SessionId(1)
    opened = [OpenSession(sid, max_len=64, drafts=4), prefill(1)]
    first = (await whole_model(held, opened))[0]
    assert isinstance(first, Verdict) and first.drafts == ()
    step = Verify(sid, E0, ChunkSeq(1), len(PROMPT), ids=first.target_ids)
    out = await whole_model(held, [*opened, step])
    assert isinstance(out[1], Verdict) and len(out[1].drafts) == 4


def test_a_tail_proposer_hands_out_the_guess_the_context_follows() -> None:
    proposer = TailProposer(6, vocab_size=100)
    assert proposer.propose([1, 2, 3], 2) == []  # before any verdict
    assert proposer.take(3, [10, 11, 12, 13, 14]) is None
    assert proposer.propose([1, 2, 3], 2) == [10, 11]
    assert proposer.propose([1, 2, 3, 10, 11], 3) == [12, 13, 14]  # a chunk pipelined on it
    assert proposer.propose([1, 2, 3, 10, 99], 3) == []  # the context left the guess
    assert proposer.propose([1, 2], 3) == []  # a context behind the verdict
    assert proposer.propose([1, 2, 3, 10, 11, 12, 13, 14], 3) == []  # all of it used


@pytest.mark.parametrize(
    ("drafts", "why"),
    [
        ((1,) * 7, "7 drafts where the session asked for 6"),
        ((5, 100), "outside"),
        ((-1,), "outside"),
    ],
)
def test_a_tail_proposer_drops_a_malformed_guess(drafts: tuple[int, ...], why: str) -> None:
    proposer = TailProposer(6, vocab_size=100)
    proposer.take(3, [10, 11])
    reason = proposer.take(3, drafts)
    assert reason is not None and why in reason
    assert proposer.propose([1, 2, 3], 4) == []  # the older guess is gone too


def test_the_draft_count_fills_the_pipeline_up_to_sixteen() -> None:
    assert tail_draft_count(3, 1) == 3
    assert tail_draft_count(3, 2) == 7
    assert tail_draft_count(8, 4) == 16
    with pytest.raises(ValueError, match="count"):
        TailProposer(0, vocab_size=100)


async def _drafting_tail(
    to_ring: trio.MemoryReceiveChannel[Message],
    from_ring: trio.MemorySendChannel[Message],
    guess: tuple[int, ...],
    seen: list[Message],
) -> None:
    """A scripted tail whose target always says 7: it answers each chunk (how many of its
    drafts are 7s held) with ``guess`` as its drafts, and records what reached it."""
    async for msg in to_ring:
        seen.append(msg)
        if isinstance(msg, Verify):
            held = next((i for i, t in enumerate(msg.draft) if t != 7), len(msg.draft))
            ids = (7,) * (len(msg.draft) + 1)
        elif isinstance(msg, Prefill) and msg.final:
            held, ids = 0, (7,)
        else:
            continue
        await from_ring.send(Verdict(msg.session, msg.epoch, msg.seq, msg.start, ids, held,
                                     drafts=guess))  # fmt: skip


async def _one_request(
    proposer: Proposer, guess: tuple[int, ...]
) -> tuple[Completion, list[Message]]:
    """One request of 8 tokens through a coordinator drafting with ``proposer`` and the
    scripted tail answering with ``guess``; what reached the tail."""
    to_send, to_recv = trio.open_memory_channel[Message](64)
    from_send, from_recv = trio.open_memory_channel[Message](64)
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"), eos_ids=[0], limits=Limits(max_len=64, prefill_chunk=4)
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
        CoordinatorAides(drafter=Drafter(lambda _prompt: proposer)),
    )
    seen: list[Message] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        nursery.start_soon(_drafting_tail, to_recv, from_send, guess, seen)
        done = await coordinator.generate(
            [1, 2, 3, 4, 5], max_tokens=8, speculation=SpeculationConfig(k=2, depth=1)
        )
        nursery.cancel_scope.cancel()
    return done, seen


@pytest.mark.parametrize(
    ("guess", "used"),
    [((7, 7, 7, 7), True), ((7,) * 5, False), ((7, 100), False), ((), False)],
    ids=["honest", "too-many", "outside-vocabulary", "none"],
)
async def test_the_coordinator_drafts_from_a_guess_it_keeps_and_goes_on_without_one(
    guess: tuple[int, ...], used: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """A tail's honest guess becomes the next chunk's drafts; a guess longer than asked, or
    with an id outside the vocabulary, is dropped (the coordinator then sends plain steps)
    and the request ends normally with the target's tokens. Prompt chunks carry their ids to
    the tail. A session that asked for no drafts and gets some goes on too."""
    done, seen = await _one_request(TailProposer(4, vocab_size=100), guess)
    assert done.token_ids == (7,) * 8
    opened = [m for m in seen if isinstance(m, OpenSession)]
    assert len(opened) == 1 and opened[0].drafts == 4
    prompt = [m for m in seen if isinstance(m, Prefill)]
    assert [m.tail_ids for m in prompt] == [(1, 2, 3, 4), (5,)]
    drafts = [m.draft for m in seen if isinstance(m, Verify)]
    if used:
        assert all(d == (7, 7) for d in drafts[:-1]) and done.stats.accepted > 0
    else:
        assert drafts and all(d == () for d in drafts)  # plain steps
    unasked, seen = await _one_request(NGramProposer(), guess)
    assert unasked.token_ids == (7,) * 8
    assert all(m.tail_ids == () for m in seen if isinstance(m, Prefill))


def test_the_tail_chains_enough_for_two_chunks_of_the_size_it_verified(held: Path) -> None:
    """After the prompt, the session's count; after a verify chunk of ``k`` drafts,
    ``2 (k + 1)`` (at least 4, at most the count): the coordinator's next chunks follow the
    size it chose, and each link is one more step of the block before the verdict leaves."""
    session = TailDrafts(MtpHead.load(held)).open(OpenSession(SessionId(1), 64, drafts=16))
    assert session is not None
    assert session.wanted(prefill(1)) == 16

    def verify(k: int) -> Verify:
        ids = tuple(range(k + 1))
        return Verify(SessionId(1), E0, ChunkSeq(1), 20, ids=ids, draft=ids[1:])

    assert [session.wanted(verify(k)) for k in (0, 1, 3, 7, 8)] == [4, 4, 8, 16, 16]

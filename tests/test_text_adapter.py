"""The coordinator's one text adapter (``shard.coordinator.text``): a request's committed
tokens arrive on a channel and are read as text, cut at stop strings, with the request's end
as a value.

Against a scripted ring (each chunk answered with the next id of a script) in virtual time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing

from shard.coordinator.config import CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator, RingError
from shard.coordinator.text import TextAdapter, TextDone, TextPiece, TextRequest
from shard.decode.state import BadRequest
from shard.messages import EndSession, Fault, Message, NodeName, Prefill, Verdict, Verify
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits
from shard.testing import tiny_tokenizer

TEXT = "héllo wörld STOP and then more"


def tokenizer() -> Tokenizer:
    return Tokenizer(
        tiny_tokenizer(), eos_ids=(), bos_id=None, chat_template=None, special_tokens={}
    )


@attrs.define
class Script:
    """The ring: answers each final chunk with the next id of ``ids``; after ``fail_after``
    answers, a fault instead."""

    ids: Sequence[int]
    fail_after: int | None = None
    answered: int = 0
    ended: list[int] = attrs.field(factory=list)

    async def run(
        self, to_ring: trio.MemoryReceiveChannel[Message], back: trio.MemorySendChannel[Message]
    ) -> None:
        async for msg in to_ring:
            if isinstance(msg, EndSession):
                self.ended.append(msg.session)
            if isinstance(msg, Prefill | Verify) and (not isinstance(msg, Prefill) or msg.final):
                if self.fail_after is not None and self.answered >= self.fail_after:
                    fault = Fault(NodeName("s0"), "stage", "scripted", session=msg.session)
                    await back.send(fault)
                    continue
                token = self.ids[self.answered]
                self.answered += 1
                await back.send(Verdict(msg.session, msg.epoch, msg.seq, msg.start, (token,), 0))


@asynccontextmanager
async def ring(script: Script) -> AsyncIterator[Coordinator]:
    to_send, to_recv = trio.open_memory_channel[Message](0)
    from_send, from_recv = trio.open_memory_channel[Message](0)
    coord = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"), eos_ids=[], limits=Limits(max_len=128, prefill_chunk=4)
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(script.run, to_recv, from_send)
        await nursery.start(coord.run)
        yield coord
        nursery.cancel_scope.cancel()


async def read(
    coord: Coordinator, text: TextAdapter, request: TextRequest
) -> tuple[list[TextPiece], TextDone]:
    pieces: list[TextPiece] = []
    async with text.stream(coord, request) as stream:
        async for piece in stream:
            pieces.append(piece)
    return pieces, stream.done


async def test_pieces_join_to_the_decoded_output(autojump_clock: trio.testing.MockClock) -> None:
    """One piece per committed batch, with its ids; the pieces and the tail join to the
    decode of every id, though characters are split across byte tokens."""
    tok = tokenizer()
    ids = tok.encode(TEXT)
    text = TextAdapter(tok)
    async with ring(Script(ids)) as coord:
        pieces, done = await read(coord, text, TextRequest((1, 2, 3), len(ids)))
    assert [p.token_ids for p in pieces] == [(t,) for t in ids]
    assert "".join(p.text for p in pieces) + done.tail == TEXT
    assert "\ufffd" not in "".join(p.text for p in pieces)
    assert any(p.text == "" for p in pieces)  # é and ö are two byte tokens: held back once
    assert (done.token_ids, done.finish_reason, done.error) == (tuple(ids), "length", None)
    assert done.stats is not None and done.stats.tokens == len(ids)


async def test_a_stop_string_ends_the_session_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The text stops before the stop string; the ids end with the token that completed it;
    the session is ended on the ring and nothing after is asked for."""
    tok = tokenizer()
    ids = tok.encode(TEXT)
    text = TextAdapter(tok)
    script = Script(ids)
    async with ring(script) as coord:
        pieces, done = await read(coord, text, TextRequest((1, 2, 3), len(ids), stop=("STOP",)))
        assert coord.sessions() == 0
    assert "".join(p.text for p in pieces) == TEXT[: TEXT.index("STOP")]
    assert done.finish_reason == "stop" and done.error is None and done.stats is None
    cut = len(tok.encode(TEXT[: TEXT.index("STOP") + 4]))
    assert done.token_ids == tuple(ids[:cut])
    assert len(script.ended) == 1 and script.answered < len(ids)


async def test_a_ring_failure_is_a_value_with_what_was_delivered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stage's fault mid-request ends the stream; ``done`` holds the RingError and the ids
    delivered before it, and the next request runs."""
    tok = tokenizer()
    ids = tok.encode(TEXT)
    text = TextAdapter(tok)
    script = Script(ids, fail_after=5)
    async with ring(script) as coord:
        pieces, done = await read(coord, text, TextRequest((1, 2, 3), len(ids)))
        assert isinstance(done.error, RingError) and "scripted" in str(done.error)
        assert done.finish_reason == "error" and done.tail == ""
        assert done.token_ids == tuple(ids[:5]) == tuple(t for p in pieces for t in p.token_ids)
        script.fail_after = None
        _, again = await read(coord, text, TextRequest((1, 2, 3), 3))
    assert again.error is None and again.token_ids == tuple(ids[5:8])


async def test_encode_checks_ids_and_takes_text_or_ids() -> None:
    """Text is tokenized, ids pass as they are, an id outside the vocabulary is refused."""
    tok = tokenizer()
    text = TextAdapter(tok)
    assert await text.encode("hello") == tok.encode("hello")
    assert await text.encode((5, 6)) == [5, 6]
    with pytest.raises(BadRequest, match="vocabulary"):
        await text.encode((tok.vocab_size,))
    assert await text.decode(tok.encode("hello")) == "hello"

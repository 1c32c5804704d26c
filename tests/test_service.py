"""The client-facing side of the coordinator: a prompt is bounded before it is tokenized, and
tokenizing never runs on the event loop."""

from __future__ import annotations

import threading

import trio

from shard.coordinator.config import CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.service import complete
from shard.coordinator.text import TextAdapter
from shard.messages import GenerateDone, GenerateRequest, Message, NodeName
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits
from shard.testing import tiny_tokenizer


class RecordingTokenizer(Tokenizer):
    """The tiny byte-level tokenizer, noting what it was asked to encode (and returning no
    ids: the request then ends as a BadRequest without needing a ring). With ``probe_loop``,
    ``encode`` asks the event loop to run a callback and waits for it: that works only from a
    worker thread while the loop is free (on the loop's own thread Trio refuses)."""

    def __init__(self, *, probe_loop: bool = False) -> None:
        super().__init__(
            tiny_tokenizer(), eos_ids=(), bos_id=None, chat_template=None, special_tokens={}
        )
        self.encoded: list[int] = []
        self.probe_loop = probe_loop
        self.loop_ran_meanwhile = False
        self.thread: int | None = None

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        self.thread = threading.get_ident()
        if self.probe_loop:
            trio.from_thread.run_sync(self._mark)
        return []

    def _mark(self) -> None:
        self.loop_ran_meanwhile = True


def coordinator(max_prompt_bytes: int) -> Coordinator:
    to_send, _ = trio.open_memory_channel[Message](1)
    _, from_recv = trio.open_memory_channel[Message](1)
    return Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=[0],
            limits=Limits(max_len=64, prefill_chunk=4, max_prompt_bytes=max_prompt_bytes),
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )


async def serve(coord: Coordinator, tokenizer: Tokenizer, prompt: str) -> list[Message]:
    sent: list[Message] = []

    async def emit(msg: Message) -> None:
        sent.append(msg)

    with trio.fail_after(30):
        await complete(coord, TextAdapter(tokenizer), GenerateRequest(1, prompt, 4), emit)
    return sent


async def test_prompt_past_the_byte_cap_is_refused_untokenized() -> None:
    """A prompt one byte over limits.max_prompt_bytes (counted in UTF-8, not characters)
    ends the request with a clear error and is never tokenized; one at the cap is."""
    tokenizer = RecordingTokenizer()
    coord = coordinator(max_prompt_bytes=1000)
    for prompt in ("a" * 1001, "é" * 501, "a" * 900_000):
        sent = await serve(coord, tokenizer, prompt)
        assert len(sent) == 1 and isinstance(sent[0], GenerateDone), sent
        assert sent[0].finish_reason == "error"
        assert "limits.max_prompt_bytes is 1000" in sent[0].error
    assert tokenizer.encoded == []
    sent = await serve(coord, tokenizer, "é" * 500)
    assert tokenizer.encoded == [500]
    assert isinstance(sent[0], GenerateDone) and "empty" in sent[0].error


async def test_tokenizing_runs_off_the_event_loop() -> None:
    """A prompt is tokenized in a worker thread while the event loop keeps running."""
    tokenizer = RecordingTokenizer(probe_loop=True)
    coord = coordinator(max_prompt_bytes=1 << 20)
    sent = await serve(coord, tokenizer, "x" * 100_000)
    assert tokenizer.encoded == [100_000]
    assert tokenizer.thread != threading.get_ident()
    assert tokenizer.loop_ran_meanwhile
    assert isinstance(sent[0], GenerateDone) and "empty" in sent[0].error

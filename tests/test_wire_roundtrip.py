"""Round trips through shard.wire: every message type, sizes that matter, the sealer seam.

Strategies are derived from each message class's type hints, so a message added to
``MESSAGE_TYPES`` is covered without touching this file (or fails loudly if it uses a type the
wire does not know).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard import messages as m
from shard.messages import MESSAGE_TYPES, TENSOR_DTYPES, Tensor
from shard.wire import PlainSealer, Sealer, WireLimits, converter, decode, encode
from shard.wire.checks import NON_NEGATIVE_FIELDS, TOKEN_FIELDS
from shard.wire.frame import HEADER_ZSTD, PREFIX
from shard.wire.limits import INT64_MAX, INT64_MIN

token_ids = st.integers(0, INT64_MAX)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    """A tensor of random dtype and shape whose data has exactly the right length."""
    dtype = draw(st.sampled_from(sorted(TENSOR_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    size = math.prod(shape) * TENSOR_DTYPES[dtype]
    return Tensor(dtype, shape, draw(st.binary(min_size=size, max_size=size)))


def strategy_for(tp: Any, name: str) -> st.SearchStrategy[Any]:
    """A strategy for values of type ``tp`` held in a field called ``name``."""
    if isinstance(tp, typing.NewType):
        return strategy_for(tp.__supertype__, name)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(0 if name in NON_NEGATIVE_FIELDS else INT64_MIN, INT64_MAX)
    if tp is float:
        return st.floats(allow_nan=False)  # NaN != NaN; test_nan_timing_survives covers it
    if tp is str:
        return st.text(max_size=24)
    if tp is Tensor:
        return tensors()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = token_ids if name in TOKEN_FIELDS else strategy_for(args[0], name)
        return st.lists(item, max_size=8).map(tuple)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(
            *(st.none() if arg is type(None) else strategy_for(arg, name) for arg in args)
        )
    if attrs.has(tp):
        return records(tp)
    raise TypeError(f"no strategy for {tp!r} (field {name!r})")


def records(cls: type) -> st.SearchStrategy[Any]:
    """Instances of the attrs class ``cls`` with every field drawn from its type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: strategy_for(hints[f.name], f.name) for f in attrs.fields(cls)}
    base = st.builds(cls, **fields)
    if cls in (m.Prefill, m.Verify):
        # A compute chunk carries ids (first edge) or hidden states (later edges), never both.
        edge = st.one_of(
            st.tuples(st.lists(token_ids, min_size=1, max_size=8).map(tuple), st.none()),
            st.tuples(st.just(()), tensors()),
        )
        return st.builds(lambda msg, e: attrs.evolve(msg, ids=e[0], hidden=e[1]), base, edge)
    return base


def verify(ids: tuple[int, ...] = (), hidden: Tensor | None = None) -> m.Verify:
    return m.Verify(m.SessionId(7), m.Epoch(1), m.ChunkSeq(42), 300, ids=ids, hidden=hidden)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_every_message_type(cls: type, data: st.DataObject) -> None:
    """decode(encode(m)) == m for every message type, with and without compression."""
    msg = data.draw(records(cls))
    for compress in (True, False):
        frame = encode(msg, compress=compress)
        back = decode(frame)
        assert back == msg
        assert type(back) is cls


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 200_000), min_size=64, max_size=2_000).map(tuple))
def test_round_trip_compressed_prefill(ids: tuple[int, ...]) -> None:
    """A prefill with many ids is compressed when that pays, and decodes to the same message."""
    msg = m.Prefill(m.SessionId(1), m.Epoch(0), m.ChunkSeq(0), 0, False, ids=ids)
    frame = encode(msg)
    plain = encode(msg, compress=False)
    assert frame[1] & HEADER_ZSTD or frame == plain
    assert len(frame) <= len(plain)
    assert decode(frame) == msg


def test_compression_used_for_repetitive_ids() -> None:
    """A long, repetitive id list sets the header-compressed flag and shrinks the frame."""
    msg = m.Prefill(m.SessionId(1), m.Epoch(0), m.ChunkSeq(0), 0, True, ids=(50_000,) * 1000)
    frame, plain = encode(msg), encode(msg, compress=False)
    assert frame[1] == HEADER_ZSTD
    assert plain[1] == 0
    assert len(frame) < len(plain) // 4
    assert decode(frame) == msg


def test_a_sampled_drafts_q_round_trips() -> None:
    """Verify.q (one DraftQ per drafted token) crosses the wire as it was: ids and floats."""
    q = (m.DraftQ((4, 9, 2), (0.5, 0.25, 0.25)), m.DraftQ((5,), (1.0,)))
    msg = decode(encode(attrs.evolve(verify(ids=(1, 4, 5)), draft=(4, 5), q=q)))
    assert isinstance(msg, m.Verify)
    assert msg.q == q
    assert type(msg.q) is tuple and type(msg.q[0].probs) is tuple


def test_tuples_stay_tuples() -> None:
    """Sequence fields (ids, hops, nested records, shapes) decode as tuples, not lists."""
    hop = m.Hop(m.NodeName("stage-0"), 0.5, 1.0, 2.0)
    hidden = Tensor("float16", (1, 2, 3), bytes(12))
    msg = decode(encode(attrs.evolve(verify(hidden=hidden), draft=(4, 5), hops=(hop,))))
    assert isinstance(msg, m.Verify)
    assert msg.hidden is not None
    assert type(msg.ids) is tuple
    assert type(msg.draft) is tuple
    assert type(msg.hops) is tuple
    assert type(msg.hidden.shape) is tuple
    assert type(msg.hidden.data) is bytes


def test_nan_timing_survives() -> None:
    """NaN and infinities in timing fields are legal and come back as such."""
    hop = m.Hop(m.NodeName("a"), math.nan, math.inf, -math.inf)
    msg = decode(encode(attrs.evolve(verify(ids=(1,)), hops=(hop,))))
    assert isinstance(msg, m.Verify)
    back = msg.hops[0]
    assert math.isnan(back.compute_s)
    assert back.received_at == math.inf
    assert back.sent_at == -math.inf


def test_nan_heartbeat_round_trips() -> None:
    """A Heartbeat whose clock reads NaN decodes to NaN (floats are not range-checked)."""
    msg = decode(encode(m.Heartbeat(m.NodeName("a"), math.nan)))
    assert isinstance(msg, m.Heartbeat)
    assert math.isnan(msg.sent_at)


def test_int_in_float_field_round_trips() -> None:
    """A float field built from an int (``sent_at=0``) decodes equal, as a float."""
    msg = decode(encode(m.Heartbeat(m.NodeName("a"), 0)))
    assert isinstance(msg, m.Heartbeat)
    assert msg.sent_at == 0
    assert type(msg.sent_at) is float


def test_ids_only_verify_is_small() -> None:
    """An ids-only Verify (last token + 4 drafts) costs a few dozen bytes on the wire."""
    msg = attrs.evolve(verify(ids=(128_000, 17, 2_931, 45_001, 9)), draft=(17, 2_931, 45_001, 9))
    frame = encode(msg)
    header = len(frame) - PREFIX.size
    print(f"ids-only Verify (K=4): frame {len(frame)} bytes, header {header} bytes")
    assert len(frame) <= 96


def test_hidden_state_costs_its_bytes_plus_small_header() -> None:
    """A float32 [1,1,576] hidden state costs 2304 payload bytes plus a small header."""
    hidden = Tensor("float32", (1, 1, 576), bytes(range(256)) * 9)
    frame = encode(verify(hidden=hidden))
    overhead = len(frame) - 2304
    print(f"Verify with float32 [1,1,576]: frame {len(frame)} bytes, overhead {overhead} bytes")
    assert 2304 < len(frame) <= 2304 + 96
    assert frame.endswith(hidden.data)  # raw, not msgpack'd or compressed


def test_payload_never_compressed() -> None:
    """Tensor bytes follow the header verbatim even when the header is compressed."""
    hidden = Tensor("int32", (4, 64), bytes(1024))
    hops = tuple(m.Hop(m.NodeName(f"stage-{i}"), 0.25, 1.0, 2.0) for i in range(12))
    msg = attrs.evolve(verify(hidden=hidden), hops=hops)
    frame = encode(msg)
    assert frame[1] == HEADER_ZSTD
    assert frame.endswith(hidden.data)
    assert decode(frame) == msg


def test_decode_accepts_bytearray_and_memoryview() -> None:
    """decode takes bytes, bytearray and memoryview (including a slice of a larger buffer)."""
    msg = verify(ids=(1, 2, 3))
    frame = encode(msg)
    assert decode(bytearray(frame)) == msg
    assert decode(memoryview(b"xx" + frame)[2:]) == msg


def test_limits_are_enforced_on_encode_too() -> None:
    """encode refuses a message that the receiver's limits would refuse."""
    from shard.wire import WireError

    small = WireLimits(max_items=4)
    with pytest.raises(WireError, match="max_items"):
        encode(verify(ids=(1, 2, 3, 4, 5)), limits=small)
    with pytest.raises(WireError, match="max_frame_bytes"):
        encode(verify(hidden=Tensor("float32", (64,), bytes(256))), limits=WireLimits(200))


def test_converter_is_one_cached_instance() -> None:
    """converter() returns the same converter every time."""
    assert converter() is converter()


def test_plain_sealer_is_identity() -> None:
    """PlainSealer seals and opens a frame unchanged and satisfies the Sealer protocol."""
    sealer = PlainSealer()
    assert isinstance(sealer, Sealer)
    frame = encode(verify(ids=(1,)))
    assert sealer.open(sealer.seal(frame)) == frame

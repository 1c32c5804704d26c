"""torch <-> wire tensors: exact round trips and refusal of malformed payloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shard.compute.tensors import from_wire, to_wire
from shard.messages import RUN_DTYPES, TENSOR_DTYPES
from shard.messages import Tensor as WireTensor

DTYPES = {name: getattr(torch, name) for name in TENSOR_DTYPES}


@pytest.mark.parametrize("name", list(TENSOR_DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    """Every wire dtype, bfloat16 included, survives to_wire/from_wire bit for bit."""
    t = (torch.randn(2, 3, 5) * 1000).to(DTYPES[name])
    w = to_wire(t)
    assert (w.dtype, w.shape, len(w.data)) == (name, (2, 3, 5), w.nbytes)
    back = from_wire(w)
    assert back.dtype == t.dtype
    assert torch.equal(back, t)


def test_run_dtypes_are_floating_wire_dtypes() -> None:
    """Every dtype a swarm may run in is a floating torch dtype that activations can carry."""
    assert set(RUN_DTYPES) <= set(TENSOR_DTYPES)
    for name in RUN_DTYPES:
        assert getattr(torch, name).is_floating_point, name
        assert torch.tensor([1.5]).to(getattr(torch, name)).element_size() == TENSOR_DTYPES[name]


def test_bfloat16_bytes_are_the_raw_bits() -> None:
    """bfloat16 travels as its 2-byte patterns (1.0 is 0x3f80), little-endian, row-major."""
    w = to_wire(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert w.data == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_non_contiguous_and_empty_tensors() -> None:
    """Transposed views are sent row-major; zero-size and 0-d tensors round-trip."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    assert torch.equal(from_wire(to_wire(t)), t)
    for t in (torch.zeros(0, 7), torch.tensor(3.5)):
        back = from_wire(to_wire(t))
        assert back.shape == t.shape
        assert torch.equal(back, t)


def test_result_owns_writable_memory() -> None:
    """The tensor from from_wire can be written without touching the message's bytes."""
    w = to_wire(torch.ones(4))
    t = from_wire(w)
    t += 1
    assert from_wire(w).tolist() == [1.0] * 4


@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_rejects_wrong_byte_count(delta: int) -> None:
    """A payload one byte short or long is a ValueError naming both sizes."""
    w = to_wire(torch.ones(2, 2))
    bad = WireTensor(
        dtype="float32", shape=(2, 2), data=w.data[:delta] if delta < 0 else w.data + b"x"
    )
    with pytest.raises(ValueError, match=r"needs 16"):
        from_wire(bad)


def test_rejects_unknown_dtype_and_bad_shape() -> None:
    """An unlisted dtype name or a negative dimension is a ValueError before any decoding."""
    with pytest.raises(ValueError, match="unknown tensor dtype 'float64'"):
        from_wire(WireTensor(dtype="float64", shape=(1,), data=b"\0" * 8))
    with pytest.raises(ValueError, match="bad tensor shape"):
        from_wire(WireTensor(dtype="int32", shape=(-1, -4), data=b"\0" * 16))


def test_to_wire_refuses_unsupported_dtypes() -> None:
    """float64 (not a wire dtype) is refused on the way out too."""
    with pytest.raises(ValueError, match="cannot travel on the wire"):
        to_wire(torch.zeros(2, dtype=torch.float64))


@given(
    name=st.sampled_from(list(TENSOR_DTYPES)),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(name: str, shape: list[int], seed: int) -> None:
    """Any shape (zeros included) and any supported dtype round-trips exactly."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 100).to(DTYPES[name])
    back = from_wire(to_wire(t))
    assert back.shape == t.shape
    assert back.dtype == t.dtype
    assert torch.equal(back, t)


def test_result_lives_in_aligned_memory() -> None:
    """from_wire's tensor starts on a 64-byte boundary (a matmul's summation order depends
    on its operands' alignment, so activations must not inherit a bytearray's)."""
    for n in (1, 3, 17, 576):
        assert from_wire(to_wire(torch.ones(2, n))).data_ptr() % 64 == 0

"""Sibling int4 products joined into one (``shard.model.fused``): the joined path gives the
bytes of the separate products — for a lone layer at every row count, and for whole stages
(prefill, decode, a verify chunk, a batch) against the same stage loaded with ``join=False``
— and holds no more memory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from shard.model.config import ModelConfig
from shard.model.footprint import measured
from shard.model.fused import PACK_BLOCK, JoinedInt4, join_siblings, joined_of
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear, _cpu_pack, quantize_int4, quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _layers(sizes: tuple[int, ...], k: int, seed: int, kind: str) -> list[QuantLinear]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=gen) for n in sizes]
    if kind == "int4":
        return [QuantLinear(quantize_int4(w)) for w in weights]
    return [QuantLinear(quantize_int8(w, group=32)) for w in weights]  # int8-group


def test_the_packer_stacks_at_its_block() -> None:
    """The CPU packer's rows stack as they are at multiples of ``PACK_BLOCK``, and not at
    other multiples of 16 (so the rule in ``_joinable`` is needed, and enough, here)."""
    codes = torch.randint(0, 256, (4 * PACK_BLOCK, 64), dtype=torch.uint8)
    whole = _cpu_pack(codes)
    for split in range(16, 4 * PACK_BLOCK, 16):
        stacked = torch.cat([_cpu_pack(codes[:split]), _cpu_pack(codes[split:])])
        assert torch.equal(stacked, whole) == (split % PACK_BLOCK == 0), split


@pytest.mark.parametrize("kind", ["int4", "int8-group"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
def test_joined_product_gives_each_siblings_bytes(rows: int, kind: str) -> None:
    """q/k/v-shaped layers joined: each output equals its own layer's, bit for bit (int8
    weights in groups stack at any row count)."""
    sizes = (3 * PACK_BLOCK, PACK_BLOCK, PACK_BLOCK) if kind == "int4" else (40, 24, 8)
    alone = _layers(sizes, 64, seed=rows, kind=kind)
    assert all(layer.path == kind for layer in alone)
    joined = JoinedInt4(_layers(sizes, 64, seed=rows, kind=kind))
    x = torch.randn(2, rows, 64)
    got = joined(x)
    for layer, piece in zip(alone, got, strict=True):
        want = layer(x)
        assert piece.shape == want.shape and piece.is_contiguous()
        assert torch.equal(piece, want)


def test_only_cpu_int4_siblings_without_bias_are_joined() -> None:
    """Siblings on different paths (int4 beside int8 per channel or int8-group), a bias,
    another input width or a first sibling whose rows are not a multiple of the packer's
    block keep the layers apart; a joined sibling runs as its slice of the joined product and
    holds nothing."""
    owner = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    owner.gate_proj = QuantLinear(quantize_int4(torch.randn(64, 64, generator=gen)))
    owner.up_proj = QuantLinear(quantize_int8(torch.randn(64, 64, generator=gen)))
    assert join_siblings(owner) == 0 and joined_of(owner, "gate_up") is None
    owner.up_proj = QuantLinear(quantize_int8(torch.randn(64, 64, generator=gen), group=32))
    assert join_siblings(owner) == 0 and joined_of(owner, "gate_up") is None
    apart = torch.nn.Module()  # int8 in groups: with offsets beside without stays apart
    plain = quantize_int8(torch.randn(64, 64, generator=gen), group=32)
    apart.gate_proj = QuantLinear(plain)
    apart.up_proj = QuantLinear(attrs.evolve(plain, offset=torch.ones_like(plain.scale)))
    assert apart.up_proj.path == "int8-group" and join_siblings(apart) == 0
    apart.up_proj = QuantLinear(plain)
    assert join_siblings(apart) == 1
    owner.up_proj = QuantLinear(
        quantize_int4(torch.randn(64, 64, generator=gen)), bias=torch.ones(64)
    )
    assert join_siblings(owner) == 0
    owner.up_proj = QuantLinear(quantize_int4(torch.randn(64, 32, generator=gen)))
    assert join_siblings(owner) == 0
    kept = owner.gate_proj
    owner.gate_proj = QuantLinear(quantize_int4(torch.randn(48, 64, generator=gen)))
    owner.up_proj = QuantLinear(quantize_int4(torch.randn(64, 64, generator=gen)))
    assert join_siblings(owner) == 0
    owner.gate_proj = kept
    x = torch.randn(3, 64)
    gate = owner.gate_proj(x)
    owner.up_proj = QuantLinear(quantize_int4(torch.randn(64, 64, generator=gen)))
    up = owner.up_proj(x)
    assert join_siblings(owner) == 1
    assert joined_of(owner, "gate_up") is not None
    assert owner.gate_proj.tensors() == [] and owner.up_proj.tensors() == []
    assert torch.equal(owner.gate_proj(x), gate) and torch.equal(owner.up_proj(x), up)
    assert join_siblings(owner) == 0  # already joined: nothing more


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_joined_stage_equals_the_separate_one(
    arch: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    """A tiny model quantized to int4 at load: with ``join`` (the default) every attention
    and feed-forward is joined (Qwen2's q/k/v carry a bias: only gate/up), and prefill,
    decode steps, a 9-row verify chunk and a batch of two give the logits of the same stage
    loaded with ``join=False``, bit for bit; the held bytes are the same."""
    model_dir = tiny_checkpoint(seed=21, arch=arch, n_layers=3, n_kv_heads=4)  # k, v: 64 rows
    n = ModelConfig.from_dir(model_dir).n_layers
    fast = load_stage(model_dir, 0, n, weights="int4")
    plain = load_stage(model_dir, 0, n, weights="int4", join=False)
    joined = [m for m in fast.modules() if isinstance(m, JoinedInt4)]
    assert len(joined) == (2 * n if arch == "llama" else n)
    assert not any(isinstance(m, JoinedInt4) for m in plain.modules())
    assert measured(fast) == measured(plain)
    with torch.inference_mode():
        ids = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7]])
        caches = fast.new_cache(64), plain.new_cache(64)
        a, b = fast(ids, 0, caches[0]), plain(ids, 0, caches[1])
        assert torch.equal(a, b)
        pos = ids.shape[1]
        for _ in range(4):
            nxt = a[:, -1].argmax(-1, keepdim=True)
            a, b = fast(nxt, pos, caches[0]), plain(nxt, pos, caches[1])
            assert torch.equal(a, b)
            pos += 1
        chunk = torch.arange(10, 19).unsqueeze(0)  # K + 1 = 9 rows
        assert torch.equal(fast(chunk, pos, caches[0]), plain(chunk, pos, caches[1]))
        two = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
        batch = fast.new_cache(16, batch=2), plain.new_cache(16, batch=2)
        assert torch.equal(fast(two, 0, batch[0]), plain(two, 0, batch[1]))


def test_a_float_stage_is_not_joined(tiny_checkpoint: Callable[..., Path]) -> None:
    """Dense float32 weights have no int4 kernel to share: nothing is joined."""
    model_dir = tiny_checkpoint(seed=21, n_layers=2)
    stage = load_stage(model_dir, 0, 2, weights="float32")
    assert not any(isinstance(m, JoinedInt4) for m in stage.modules())


_RSS_ADDED = """
import sys
from shard.model.loader import load_stage
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
stage = load_stage(sys.argv[1], 0, 30, weights="stored", join=sys.argv[2] == "1")
print(rss() - base)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_joining_leaves_no_resident_temporaries(smollm2_dir: Path) -> None:
    """The packed tensors joining frees are load temporaries: a fresh process that loads
    SmolLM2 stored keeps as much resident memory joined as apart (joined after the loader's
    heap guard, it kept 5-25 MiB more in runs here)."""
    added = []
    for join in ("0", "1"):
        done = subprocess.run(
            [sys.executable, "-c", _RSS_ADDED, str(smollm2_dir), join],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        added.append(int(done.stdout.split()[-1]))
    apart, joined = added
    assert joined <= apart + 2 * 2**20, (
        f"joined {joined / 2**20:.1f} MiB, apart {apart / 2**20:.1f}"
    )

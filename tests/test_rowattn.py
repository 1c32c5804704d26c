"""Row attention (``shard.model.rowattn``, issue 42): a short chunk's attention in one stated
order per row. The compiled kernel, in every version this CPU runs, gives the torch
reference's bytes; a row gives the same bytes alone (its decode step) as in a chunk; the
stated pieces (exp, the pairwise sum) are what they say; a quantized block attends through it
and its verify chunk equals its decode steps."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from shard.model import rowattn
from shard.model.loader import load_stage
from shard.model.masks import causal_mask
from shard.model.native_build import build

CPU = torch.device("cpu")

#: (batch, heads, KV heads, rows, keys, head dim, window): keys within a chunk of 16, across
#: several (an odd count of chunks: the carried one), a sliding window hiding whole chunks,
#: grouped queries 1:1 to 8:1, batch 2, head widths 16 to 256.
SHAPES = [
    (1, 4, 1, 1, 1, 32, None),
    (1, 4, 1, 1, 17, 32, None),
    (1, 4, 1, 9, 109, 256, None),
    (2, 8, 2, 9, 40, 64, 7),
    (1, 2, 2, 3, 70, 16, None),
    (1, 8, 1, 16, 600, 128, 512),
    (1, 3, 3, 5, 33, 48, 20),
]


def _ext():  # type: ignore[no-untyped-def]
    ext = build()
    if isinstance(ext, str):
        pytest.skip(f"no native extension here: {ext}")
    return ext


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns, every NaN as one (NaN payloads are not part of the order)."""
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


def _inputs(b: int, h: int, kv: int, s: int, n: int, dh: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, dh, generator=gen)
    # keys and values as a cache's first n positions: strided, not contiguous
    k = torch.randn(b, kv, n + 7, dh, generator=gen)[:, :, :n]
    v = torch.randn(b, kv, n + 7, dh, generator=gen)[:, :, :n]
    return q, k, v


@pytest.mark.parametrize(("b", "h", "kv", "s", "n", "dh", "window"), SHAPES)
def test_every_kernel_version_gives_the_reference_bytes(
    b: int, h: int, kv: int, s: int, n: int, dh: int, window: int | None
) -> None:
    ext = _ext()
    q, k, v = _inputs(b, h, kv, s, n, dh, seed=n * dh + s)
    mask = causal_mask(n - s, s, CPU, window)
    want = rowattn.reference(q, k, v, mask, dh**-0.5)
    for isa in (0, 1, 2):
        got = ext.row_attention(q, k, v, mask, dh**-0.5, isa)
        assert torch.equal(_bits(got), _bits(want)), (isa, (got - want).abs().max())
    # and it is attention: close to torch's in float64
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=dh**-0.5, enable_gqa=True
    )
    assert (want.double() - sdpa).abs().max() < 1e-5


def test_hostile_values_give_the_reference_bytes() -> None:
    ext = _ext()
    q, k, v = _inputs(1, 4, 2, 3, 40, 32, seed=7)
    q[0, 0, 0, 3] = float("nan")
    k[0, 1, 2, 1] = float("inf")
    v[0, 0, 1, 0] = 3e38
    v[0, 1, 5, 2] = float("-inf")
    q[0, 3, 2] *= 1e-42  # subnormal
    k[0, 0, 30:] = -1e30  # scores far below the floor of exp
    mask = causal_mask(37, 3, CPU, None)
    want = rowattn.reference(q, k, v, mask, 32**-0.5)
    assert bool(want.isnan().any()) and bool(want.isfinite().any())
    for isa in (0, 1, 2):
        got = ext.row_attention(q, k, v, mask, 32**-0.5, isa)
        assert torch.equal(_bits(got), _bits(want)), isa


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_gives_its_bytes_in_a_chunk(threads: int) -> None:
    """Row i of a chunk at start equals the one-row call at start + i over keys [0, start+i]
    (its decode step), bit for bit, whatever the thread count."""
    _ext()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start, s, dh = 50, 9, 64
        q, k, v = _inputs(1, 4, 1, s, start + s, dh, seed=3)
        for window in (None, 20):
            chunk = rowattn.attend_rows(q, k, v, causal_mask(start, s, CPU, window), 0.125)
            for i in range(s):
                alone = rowattn.attend_rows(
                    q[:, :, i : i + 1],
                    k[:, :, : start + i + 1],
                    v[:, :, : start + i + 1],
                    causal_mask(start + i, 1, CPU, window),
                    0.125,
                )
                assert torch.equal(_bits(alone[:, :, 0]), _bits(chunk[:, :, i])), (window, i)
    finally:
        torch.set_num_threads(before)


def test_stated_exp_is_exp_within_two_ulps() -> None:
    x = -torch.linspace(0, 87, 200_001)
    got = rowattn.stated_exp(x).double()
    want = torch.exp(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(math.inf)) - want.float()).double()
    assert ((got - want).abs() / ulp).max() <= 2.0
    tail = rowattn.stated_exp(torch.tensor([-87.5, -1e30, float("-inf"), float("nan"), -0.0]))
    assert tail[:3].tolist() == [0.0, 0.0, 0.0]
    assert math.isnan(tail[3].item()) and tail[4].item() == 1.0


def test_pairwise_sum_is_neighbours_added_the_last_carried() -> None:
    def stated(xs: list[float]) -> float:
        while len(xs) > 1:
            pairs = [xs[i] + xs[i + 1] for i in range(0, len(xs) - 1, 2)]
            xs = pairs + (xs[-1:] if len(xs) % 2 else [])
            xs = [float(torch.tensor(x, dtype=torch.float32)) for x in xs]
        return xs[0]

    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 5, 8, 11, 13, 31):
        t = torch.randn(n, generator=gen) * torch.logspace(0, 6, n)
        assert rowattn.pairwise_sum(t[None], -1).item() == stated(t.tolist()), n


def test_without_the_extension_the_reference_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ext = _ext()
    q, k, v = _inputs(1, 4, 1, 9, 30, 32, seed=5)
    mask = causal_mask(21, 9, CPU, None)
    compiled = ext.row_attention(q, k, v, mask, 0.2, -1)
    monkeypatch.setattr(rowattn, "build", lambda: "no compiler here")
    rowattn._fallback_warning.cache_clear()
    with caplog.at_level(logging.WARNING, logger="shard.model.rowattn"):
        plain = rowattn.attend_rows(q, k, v, mask, 0.2)
    assert torch.equal(_bits(plain), _bits(compiled))
    assert "no compiler here" in caplog.text


def test_keys_of_any_layout_give_the_same_bytes() -> None:
    _ext()
    q, k, v = _inputs(1, 4, 2, 3, 20, 32, seed=11)
    mask = causal_mask(17, 3, CPU, None)
    want = rowattn.attend_rows(q, k, v, mask, 0.3)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # the head dimension strided
    vt = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert kt.stride(-1) != 1
    assert torch.equal(
        rowattn.attend_rows(q.transpose(1, 2).contiguous().transpose(1, 2), kt, vt, mask, 0.3), want
    )


def test_what_it_does_not_take() -> None:
    q, k, _ = _inputs(1, 4, 1, 2, 10, 32, seed=2)
    mask = causal_mask(8, 2, CPU, None)
    assert rowattn.fits(q, k, mask)
    assert not rowattn.fits(q.double(), k.double(), mask)
    assert not rowattn.fits(q[..., :24], k[..., :24], mask)  # head dim not a multiple of 16
    assert not rowattn.fits(q, k, mask.float())
    assert not rowattn.fits(q, k, mask[None])
    assert not rowattn.fits(q[:, :3], k[:, :1].expand(1, 2, 10, 32), mask)  # 3 heads over 2
    ext = _ext()
    with pytest.raises(RuntimeError, match="row attention"):
        ext.row_attention(q[..., :24].contiguous(), k[..., :24], k[..., :24], mask, 0.1, -1)


def test_a_quantized_block_attends_through_it_and_verifies_as_it_decodes(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage of int8 weights (eager: the native forward off) attends its decode steps and its
    9-row verify chunk through row attention, one call a layer each, and the chunk's logits are
    its decode steps' bit for bit."""
    model_dir = tiny_checkpoint(seed=37, n_layers=2)  # head dim 16
    stage = load_stage(model_dir, 0, 2, weights="int8", join=False)
    calls: list[int] = []
    real = rowattn.attend_rows

    def spy(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(q.shape[2])
        return real(q, *args, **kw)

    monkeypatch.setattr(rowattn, "attend_rows", spy)
    prompt, chunk = torch.tensor([[5, 9, 2, 44]]), torch.tensor([[7, 3, 19, 1, 8, 60, 2, 11, 4]])
    with torch.inference_mode():
        stepped, at_once = stage.new_cache(32), stage.new_cache(32)
        stage(prompt, 0, stepped)
        stage(prompt, 0, at_once)
        calls.clear()
        steps = [stage(chunk[:, i : i + 1], 4 + i, stepped) for i in range(9)]
        verified = stage(chunk, 4, at_once)
    assert calls == [1] * 18 + [9] * 2
    assert torch.equal(torch.cat(steps, dim=1), verified)

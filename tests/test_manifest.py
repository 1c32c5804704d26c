"""Manifests: build, canonical encoding, signing, every tamper caught with its own reason,
rollback refusal, the tensor map against the safetensors bytes, the block selection against
the loader's, the CLI, and a manifest of the bundled SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors import safe_open

from shard.cli import main as shard_main
from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import hf_name
from shard.trust.identity import NodeIdentity
from shard.weights.build import build_manifest
from shard.weights.manifest import (
    Manifest,
    ManifestInvalid,
    ManifestMismatch,
    TensorEntry,
    canonical_json,
    check_newer,
    digest,
    verify,
    verify_chunk,
)
from shard.weights.plan import block_chunks, block_tensors, chunk_span

CHUNK = 4096


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shard.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), n_layers=4, seed=5)


@pytest.fixture(scope="module")
def publisher() -> NodeIdentity:
    return NodeIdentity.from_seed(bytes(range(32)))


@pytest.fixture(scope="module")
def signed(tiny_dir: Path, publisher: NodeIdentity) -> Manifest:
    return build_manifest(tiny_dir, model="tiny", version=3, chunk_size=CHUNK).signed(publisher)


def edited(manifest: Manifest, edit: Any) -> Manifest:
    """The manifest after ``edit(body)`` changed its JSON body in place (signature kept)."""
    envelope = json.loads(manifest.to_json())
    edit(envelope["manifest"])
    return Manifest.from_json(canonical_json(envelope))


def test_build_sign_verify_round_trip(
    tmp_path: Path, signed: Manifest, publisher: NodeIdentity
) -> None:
    """A built and signed manifest saves, loads equal, and verifies against its publisher."""
    path = tmp_path / "m.json"
    signed.save(path)
    back = Manifest.from_file(path)
    assert back == signed
    verify(back, publisher.public)
    assert back.n_layers == 4
    assert back.architecture == "LlamaForCausalLM"
    assert {f.path for f in back.files} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_canonical_encoding_is_stable(signed: Manifest) -> None:
    """The file bytes are canonical: re-encoding, or re-parsing reordered JSON, gives the same."""
    data = signed.to_json()
    assert data == signed.to_json()
    assert data == canonical_json(json.loads(data)) + b"\n"  # sorted keys, no whitespace
    reordered = json.dumps(json.loads(data), indent=3).encode()  # same JSON, other layout
    again = Manifest.from_json(reordered)
    assert again.to_json() == data
    assert again.signed_bytes() == signed.signed_bytes()


def test_build_is_deterministic(tiny_dir: Path) -> None:
    """Two builds of the same directory give byte-identical manifests and roots."""
    a = build_manifest(tiny_dir, model="tiny", version=1, chunk_size=CHUNK)
    b = build_manifest(tiny_dir, model="tiny", version=1, chunk_size=CHUNK)
    assert a.to_json() == b.to_json()
    assert a.root == b.root


def test_tensor_map_points_at_the_tensor_bytes(tiny_dir: Path, signed: Manifest) -> None:
    """Each tensor's byte range in the file holds exactly that tensor's data."""
    data = (tiny_dir / "model.safetensors").read_bytes()
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            t = signed.tensors[name]
            tensor = f.get_tensor(name).contiguous()
            assert data[t.start : t.end] == tensor.view(torch.uint8).numpy().tobytes()
            assert list(t.shape) == list(tensor.shape)
    assert set(signed.tensors) == names


@pytest.mark.parametrize(
    ("what", "edit", "error", "reason"),
    [
        (
            "chunk hash",
            lambda b: b["files"][1]["chunks"].__setitem__(2, "0" * 64),
            ManifestMismatch,
            r"model.safetensors: its chunk hashes do not match its root",
        ),
        ("root", lambda b: b.__setitem__("root", "1" * 64), ManifestMismatch, r"^root: hash"),
        (
            "tensor map",
            lambda b: b["tensors"]["model.norm.weight"].__setitem__(
                "start", b["tensors"]["model.norm.weight"]["start"] + 4
            ),
            ManifestMismatch,
            r"^tensor map: hash .* a tensor's file or range was altered",
        ),
        (
            "tensor map out of the file",
            lambda b: b["tensors"]["model.norm.weight"].__setitem__("end", 1 << 40),
            ManifestInvalid,
            r"model.norm.weight claims bytes .* outside its data section",
        ),
        (
            "version",
            lambda b: b.__setitem__("version", 4),
            ManifestMismatch,
            r"^header: hash .* version",
        ),
        (
            "file list",
            lambda b: b["files"][0].__setitem__("size", b["files"][0]["size"] - 1),
            ManifestMismatch,
            r"config.json: its chunk hashes do not match its root",
        ),
    ],
)
def test_every_tamper_is_caught_with_its_reason(
    signed: Manifest, publisher: NodeIdentity, what: str, edit: Any, error: type, reason: str
) -> None:
    """Editing any part of a signed manifest fails verification, saying which part."""
    with pytest.raises(error, match=reason):
        verify(edited(signed, edit), publisher.public)


def test_consistent_rehash_still_fails_the_signature(
    signed: Manifest, publisher: NodeIdentity
) -> None:
    """A tamperer who recomputes every hash after changing the version hits the signature."""
    forged = attrs.evolve(attrs.evolve(signed, version=9).sealed(), publisher=signed.publisher)
    forged = attrs.evolve(forged, signature=signed.signature)
    with pytest.raises(ManifestInvalid, match=r"^signature: not a valid signature"):
        verify(forged, publisher.public)


def test_signature_tamper_and_wrong_publisher(signed: Manifest, publisher: NodeIdentity) -> None:
    """A flipped signature bit, another publisher's key and no signature are each refused."""
    assert signed.signature is not None
    flipped = bytes([signed.signature[0] ^ 1]) + signed.signature[1:]
    with pytest.raises(ManifestInvalid, match="not a valid signature"):
        verify(attrs.evolve(signed, signature=flipped), publisher.public)
    other = NodeIdentity.from_seed(bytes(32))
    with pytest.raises(ManifestInvalid, match="not by the expected publisher"):
        verify(signed, other.public)
    with pytest.raises(ManifestInvalid, match="unsigned"):
        verify(attrs.evolve(signed, publisher=None, signature=None), publisher.public)
    resigned = signed.signed(other)  # a valid signature, by the wrong key
    with pytest.raises(ManifestInvalid, match="not by the expected publisher"):
        verify(resigned, publisher.public)


def test_check_newer_refuses_rollback(tiny_dir: Path, publisher: NodeIdentity) -> None:
    """A newer version replaces an older one; the same one is fine; older, equal or foreign no."""
    v3 = build_manifest(tiny_dir, model="tiny", version=3, chunk_size=CHUNK)
    v4 = build_manifest(tiny_dir, model="tiny", version=4, chunk_size=CHUNK)
    check_newer(v3, v4)
    check_newer(v4, v4)
    with pytest.raises(ManifestInvalid, match=r"not newer than version 4.*rollback"):
        check_newer(v4, v3)
    other_v4 = build_manifest(tiny_dir, model="tiny", version=4, chunk_size=2 * CHUNK)
    with pytest.raises(ManifestInvalid, match="not newer"):
        check_newer(v4, other_v4)
    with pytest.raises(ManifestInvalid, match="not 'tiny'"):
        check_newer(v3, build_manifest(tiny_dir, model="other", version=9, chunk_size=CHUNK))


def test_verify_chunk(tiny_dir: Path, signed: Manifest) -> None:
    """A chunk verifies byte for byte; one changed byte or a short read does not."""
    data = (tiny_dir / "model.safetensors").read_bytes()
    chunk = data[CHUNK : 2 * CHUNK]
    verify_chunk(signed, "model.safetensors", 1, chunk)
    with pytest.raises(ManifestMismatch, match="chunk 1: hash does not match"):
        verify_chunk(signed, "model.safetensors", 1, b"\xff" + chunk[1:])
    with pytest.raises(ManifestMismatch, match="bytes, the manifest says 4096"):
        verify_chunk(signed, "model.safetensors", 1, chunk[:-1])
    with pytest.raises(ManifestInvalid, match="no chunk"):
        verify_chunk(signed, "config.json", 5, b"")


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda b: b["files"][0].__setitem__("path", "../../etc/passwd"),
            "relative POSIX|normalised",
        ),
        (lambda b: b["files"][0].__setitem__("path", ".hidden"), "hidden"),
        (lambda b: b.__setitem__("extra", 1), "extra: unknown field"),
        (lambda b: b.__setitem__("root", "XYZ"), "root: expected 64 lowercase hex"),
        (lambda b: b.__setitem__("version", True), "version: expected an integer"),
        (lambda b: b.__setitem__("format", "other/9"), "format is 'other/9'"),
    ],
)
def test_malformed_manifests_are_refused_at_parse(signed: Manifest, edit: Any, reason: str) -> None:
    """Unsafe paths, unknown fields and wrongly typed values never make a Manifest."""
    envelope = json.loads(signed.to_json())
    edit(envelope["manifest"])
    with pytest.raises(ManifestInvalid, match=reason):
        Manifest.from_json(canonical_json(envelope))


@pytest.mark.parametrize("key", ["signature", "publisher"])
@pytest.mark.parametrize(
    "respell",
    [str.upper, lambda h: h[:-2], lambda h: h + "00", lambda h: h[:-2] + " 0", lambda h: "0x" + h],
    ids=["uppercase", "short", "long", "space", "prefixed"],
)
def test_signature_hex_is_canonical(
    signed: Manifest, publisher: NodeIdentity, key: str, respell: Any
) -> None:
    """The signature and publisher are read in lowercase hex of their exact length only."""
    envelope = json.loads(signed.to_json())
    envelope[key] = respell(envelope[key])
    with pytest.raises(ManifestInvalid, match=f"{key}: expected .* lowercase hex digits"):
        verify(Manifest.from_json(canonical_json(envelope)), publisher.public)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("block", [(0, 2), (1, 3), (2, 4), (0, 4), (3, 4)])
def test_block_tensors_match_the_loader(
    tiny_checkpoint: Any, tied: bool, block: tuple[int, int]
) -> None:
    """The fetch plan names exactly the checkpoint tensors load_stage reads for the block."""
    model_dir = tiny_checkpoint(n_layers=4, tie_word_embeddings=tied)
    manifest = build_manifest(model_dir, model="tiny", version=1, chunk_size=CHUNK)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        stage = StageModel(config, *block)
    loader = {hf_name(config, block[0], n) for n, _ in stage.named_parameters()}
    assert set(block_tensors(manifest, *block)) == loader


def test_block_chunks_cover_headers_and_small_files(signed: Manifest) -> None:
    """A middle block needs every small file whole, the safetensors header, and its tensors."""
    plan = block_chunks(signed, 1, 3)
    assert plan["config.json"] == (0,)
    weights = signed.file("model.safetensors")
    assert set(chunk_span(0, weights.header, CHUNK)) <= set(plan["model.safetensors"])
    assert len(plan["model.safetensors"]) < len(weights.chunks) * 3 // 4
    assert chunk_span(5, 5, CHUNK) == range(0)
    assert list(chunk_span(CHUNK - 1, CHUNK + 1, CHUNK)) == [0, 1]


def test_digest_is_domain_separated() -> None:
    """The same bytes under different domains hash differently (a chunk is never a root)."""
    assert digest(b"x") != digest(b"x", b"file\0")
    assert len(digest(b"")) == 64


def test_tensor_entry_json_round_trip() -> None:
    """TensorEntry's JSON form keeps every field."""
    t = TensorEntry("model.safetensors", 8, 16, "F32", (2,))
    assert TensorEntry(**{**t.to_json(), "shape": tuple(t.to_json()["shape"])}) == t


def test_cli_build_sign_verify(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard manifest build`, `sign` and `verify` (also against the directory) work end to end."""
    key = tmp_path / "publisher.key"
    assert shard_main(["keygen", "--out", str(key)]) == 0
    out = tmp_path / "m.json"
    build = ["manifest", "build", str(tiny_dir), "--out", str(out), "--chunk-size", "4096"]
    assert shard_main([*build, "--version", "2"]) == 0
    assert "version=2" in capsys.readouterr().out
    assert shard_main(["manifest", "verify", str(out), "--publisher", f"{key}.pub"]) == 1
    assert "unsigned" in capsys.readouterr().err
    assert shard_main(["manifest", "sign", str(out), "--key", str(key)]) == 0
    verify_cmd = ["manifest", "verify", str(out), "--publisher", f"{key}.pub"]
    assert shard_main([*verify_cmd, "--model", str(tiny_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok manifest=")
    assert shard_main([*build, "--version", "1"]) == 1  # OUT exists: never replaced silently
    older = tmp_path / "old.json"
    assert shard_main([*build[:4], str(older), "--chunk-size", "4096", "--key", str(key)]) == 0
    assert shard_main([*verify_cmd, "--previous", str(out)]) == 0
    rollback = ["manifest", "verify", str(older), "--publisher", f"{key}.pub"]
    assert shard_main([*rollback, "--previous", str(out)]) == 1
    assert "rollback" in capsys.readouterr().err


def test_cli_verify_reports_a_changed_directory(
    tmp_path: Path, tiny_dir: Path, publisher: NodeIdentity, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard manifest verify --model` names the file and chunk that differ on disk."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    manifest = build_manifest(copy, model="tiny", version=1, chunk_size=CHUNK).signed(publisher)
    manifest.save(tmp_path / "m.json")
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(3 * CHUNK + 10)
        f.write(b"\x00\x01")
    args = ["manifest", "verify", str(tmp_path / "m.json"), "--publisher", publisher.public.hex()]
    assert shard_main([*args, "--model", str(copy)]) == 1
    assert "model.safetensors: chunks [3] do not match" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_smollm2_gets_a_manifest(smollm2_dir: Path) -> None:
    """The converted bundled model builds into a manifest that verifies once signed."""
    publisher = NodeIdentity.generate()
    manifest = build_manifest(smollm2_dir, model="smollm2", version=1).signed(publisher)
    verify(Manifest.from_json(manifest.to_json()), publisher.public)
    assert manifest.n_layers == 30
    assert manifest.tie_word_embeddings
    assert "model.layers.29.mlp.down_proj.weight" in manifest.tensors
    plan = block_chunks(manifest, 10, 20)
    weights = manifest.file("model.safetensors")
    assert len(plan["model.safetensors"]) < len(weights.chunks) // 2


def test_a_duplicated_signature_key_is_refused(
    tmp_path: Path, signed: Manifest, publisher: NodeIdentity, capsys: pytest.CaptureFixture[str]
) -> None:
    """`{"manifest":…, "signature": good, "signature": other}` never verifies: a key given twice
    anywhere in a manifest is refused at parse, in one line (the CLI exits 1)."""
    text = signed.to_json().decode().rstrip("\n")
    good = json.loads(text)["signature"]
    other = "00" * 64
    twice = text[:-1] + f',"signature":"{good}"}}'  # good one last: json.loads would keep it
    first = text.replace(f'"signature":"{good}"', f'"signature":"{other}"')
    for spelling in (first[:-1] + f',"signature":"{good}"}}', twice):
        with pytest.raises(ManifestInvalid, match="duplicate JSON key 'signature'"):
            Manifest.from_json(spelling.encode())
    inner = text.replace('"format":', '"version":99,"format":', 1)
    with pytest.raises(ManifestInvalid, match="duplicate JSON key 'version'"):
        Manifest.from_json(inner.encode())
    path = tmp_path / "twice.json"
    path.write_text(first[:-1] + f',"signature":"{good}"}}')
    assert shard_main(["manifest", "verify", str(path), "--publisher", publisher.public.hex()]) == 1
    err = capsys.readouterr().err.strip()
    assert "duplicate JSON key 'signature'" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000, "[" * 65 + "]" * 65],
    ids=["lists-100000", "objects-100000", "lists-65"],
)
def test_deeply_nested_manifest_is_refused_in_one_line(
    tmp_path: Path, publisher: NodeIdentity, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON nested beyond what the parser follows, or beyond 64 levels, is a one-line
    ManifestInvalid and exit code 1, never a RecursionError traceback."""
    with pytest.raises(ManifestInvalid, match="nested"):
        Manifest.from_json(text.encode())
    path = tmp_path / "deep.json"
    path.write_text(text)
    assert shard_main(["manifest", "verify", str(path), "--publisher", publisher.public.hex()]) == 1
    err = capsys.readouterr().err.strip()
    assert "nested" in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"a":' * 70 + b"1" + b"}" * 70, "nested more than 64"),
        (
            b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],'
            b'"data_offsets":[4,8]}}',
            "duplicate JSON key 'w'",
        ),
        (b"[1]", "not a JSON object"),
    ],
    ids=["past-the-parser", "past-64", "tensor-twice", "not-an-object"],
)
def test_a_hostile_safetensors_header_is_refused_when_building(
    tmp_path: Path, header: bytes, says: str
) -> None:
    """`manifest build` reads safetensors headers strictly: deep nesting, a tensor named
    twice (two byte ranges) or a header that is not an object is a one-line ManifestInvalid."""
    from shard.weights.build import safetensors_tensors

    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ManifestInvalid, match=says) as refused:
        safetensors_tensors(path, "model.safetensors")
    assert "\n" not in str(refused.value)

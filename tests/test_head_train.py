"""``shard draft train``: features cache, resumable training, publishing, the cache, the CLI.

Everything runs on a tiny random checkpoint (a 4-layer target) with budgets of seconds.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from shard.cli import draft as head_cli
from shard.cli import main as cli_main
from shard.decode.head.model import DraftHead, HeadError
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.head import build
from shard.training.head import cache as head_cache
from shard.training.head.build import MARKER, HeadRecipe, train_head, work_dir_for
from shard.training.head.cache import HeadNotFound, cached_head, head_dir, resolve_head
from shard.training.head.features import FEATURES_VERSION, MANIFEST, FeatureStore
from shard.training.head.measure import chained_acceptance
from shard.training.head.train import greedy_targets, reference_features
from shard.training.head.trainer import Trainer, TrainSettings

TINY = HeadRecipe(
    minutes=1.0,
    data_share=0.001,  # one chunk of features
    shortlist=64,
    seq_len=96,
    rows_per_chunk=8,
    train=TrainSettings(batch=4, max_steps=6, checkpoint_every=2, ce_positions=64),
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def target_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(n_layers=4)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points ``cache_dir()`` at a temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "shard"


def test_train_head_publishes_a_complete_head(target_dir: Path, tmp_path: Path) -> None:
    """``train_head`` writes a loadable head and a report, and leaves no temporary behind."""
    out = tmp_path / "h"
    report = train_head(target_dir, out, tmp_path / "f", TINY, progress=False)
    marker = json.loads((out / MARKER).read_text())
    assert marker["steps"] == report.steps == 6 and marker["head_version"] == 1
    m = marker["measured"]
    assert len(m["alpha"]) == len(m["committed"]) == 4 and m["starts"] > 0
    assert all(0.0 <= a <= 1.0 for a in m["alpha"]) and m["draft_ms"] > 0 < m["target_ms"]
    assert marker["feature_tokens"] > 0 and marker["positions_trained"] > 0
    parts = marker["data_s"] + marker["train_wall_s"] + marker["measure_s"]
    assert marker["wall_s"] >= parts - 0.2 and marker["train_wall_s"] >= marker["train_s"] - 0.1
    head = DraftHead.load(out)
    assert head.config.shortlist == 64 and len(head.shortlist) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "h"]
    with pytest.raises(HeadError, match="already exists"):
        train_head(target_dir, out, tmp_path / "f", TINY, progress=False)


def test_features_are_made_once_and_reused(target_dir: Path, tmp_path: Path) -> None:
    """A rerun samples nothing new when the cache already holds its budget's worth."""
    train_head(target_dir, tmp_path / "a", tmp_path / "f", TINY, progress=False)
    manifest = json.loads((tmp_path / "f" / MANIFEST).read_text())
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").iterdir()}
    train_head(target_dir, tmp_path / "b", tmp_path / "f", TINY, progress=False)
    assert json.loads((tmp_path / "f" / MANIFEST).read_text()) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").iterdir()} == stamps


def test_feature_store_ignores_stray_and_damaged_chunks(target_dir: Path, tmp_path: Path) -> None:
    """A chunk the manifest does not list is ignored; a listed one that is damaged is
    dropped and made again; a damaged manifest starts the store over."""
    target = load_stage(target_dir, 0, 4)
    tok = Tokenizer.from_dir(target_dir)
    root = tmp_path / "f"

    def store() -> FeatureStore:
        return FeatureStore(root, seq_len=96, seed=0, rows_per_chunk=4)

    store().fill(target, tok, 0.0, progress=False)
    (root / "chunk-00007.safetensors").write_bytes(b"half a chunk")
    assert [c["file"] for c in store()._manifest["chunks"]] == ["chunk-00000.safetensors"]
    good = (root / "chunk-00000.safetensors").read_bytes()
    (root / "chunk-00000.safetensors").write_bytes(good[:100])
    s = store()
    assert s.tokens == 0
    s.fill(target, tok, 0.0, progress=False)
    assert s.load().corpus.ids.shape == (4, 96)
    (root / MANIFEST).write_text("{not json")
    assert store().tokens == 0


def test_a_fixed_count_of_chunks_is_the_same_data_anywhere(
    target_dir: Path, tmp_path: Path
) -> None:
    """``chunks`` fills to exactly that many chunks whatever the time budget (none here, and
    a budget of an hour does not add more), ``load(chunks)`` reads only the first ones, and
    two stores with the same seed hold the same rows."""
    target = load_stage(target_dir, 0, 4)
    tok = Tokenizer.from_dir(target_dir)
    a = FeatureStore(tmp_path / "a", seq_len=96, seed=3, rows_per_chunk=4)
    a.fill(target, tok, 0.0, chunks=3, progress=False)
    assert len(a._manifest["chunks"]) == 3
    a.fill(target, tok, 3600.0, chunks=3, progress=False)
    assert len(a._manifest["chunks"]) == 3
    b = FeatureStore(tmp_path / "b", seq_len=96, seed=3, rows_per_chunk=4)
    b.fill(target, tok, 3600.0, chunks=2, progress=False)
    assert torch.equal(a.load(2).corpus.ids, b.load().corpus.ids)
    assert a.load().corpus.ids.shape == (12, 96) and a.load(1).corpus.ids.shape == (4, 96)


def test_a_bf16_sampler_makes_the_text_and_the_fp32_target_labels_it(
    target_dir: Path, tmp_path: Path
) -> None:
    """With a bf16 copy of the target as the sampler, the store holds finite features of the
    text it sampled, and each position's greedy label is the fp32 target's head applied to
    that feature (not the bf16 head's)."""
    target = load_stage(target_dir, 0, 4)
    sampler = load_stage(target_dir, 0, 4, dtype=torch.bfloat16)
    tok = Tokenizer.from_dir(target_dir)
    store = FeatureStore(tmp_path / "f", seq_len=96, seed=5, rows_per_chunk=8)
    store.fill(target, tok, 0.0, chunks=1, progress=False, sampler=sampler)
    data = store.load()
    assert data.corpus.ids.shape == (8, 96) and bool(data.corpus.labels.isfinite().all())
    assert torch.equal(data.greedy, greedy_targets(target, data.corpus))


def test_the_sampling_dtype_keys_the_caches(
    target_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "auto" samples in bf16 exactly where the CPU has bf16 instructions; fp32 keeps the
    cache keys made before there was a choice, and bf16 text gets caches of its own."""
    monkeypatch.setattr(build, "cpu_has_bf16", lambda: False)
    assert HeadRecipe().sampling_dtype() == "float32"
    monkeypatch.setattr(build, "cpu_has_bf16", lambda: True)
    assert HeadRecipe().sampling_dtype() == "bfloat16"
    assert HeadRecipe(sample_dtype="float32").sampling_dtype() == "float32"
    fp32, bf16 = HeadRecipe(sample_dtype="float32"), HeadRecipe(sample_dtype="bfloat16")
    name = target_dir.resolve().name
    old = head_cache._key(FEATURES_VERSION, name, fp32.seq_len, fp32.seed, fp32.rows_per_chunk)
    assert head_cache.features_dir(target_dir, "t", fp32).name == f"t-{old}"
    assert head_cache.features_dir(target_dir, "t", bf16) != head_cache.features_dir(
        target_dir, "t", fp32
    )
    assert head_dir(target_dir, "t", bf16) != head_dir(target_dir, "t", fp32)
    with pytest.raises(ValueError, match="sample_dtype"):
        HeadRecipe(sample_dtype="int8")


def interrupted_after(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """Ctrl-C arrives once ``steps`` training steps are done (the next one is interrupted)."""
    one_step = Trainer._one_step

    def step(self: Trainer, budget_s: float) -> tuple[float, float]:
        if self.step == steps:
            raise KeyboardInterrupt
        return one_step(self, budget_s)

    monkeypatch.setattr(Trainer, "_one_step", step)


def test_an_interrupted_run_resumes_where_it_stopped(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C mid-training leaves a checkpoint; the next run resumes from it and ends with
    exactly the head an uninterrupted run trains."""
    out = tmp_path / "h"
    with monkeypatch.context() as patched:
        interrupted_after(patched, 3)
        with pytest.raises(KeyboardInterrupt):
            train_head(target_dir, out, tmp_path / "f", TINY, progress=False)
    assert not out.exists()
    assert [p.name for p in work_dir_for(out).iterdir()] == ["ckpt-00000003"]
    report = train_head(target_dir, out, tmp_path / "f", TINY, progress=False)
    assert report.resumed_from_step == 3 and report.steps == 6
    assert not work_dir_for(out).exists()  # published: the training state is gone
    straight = tmp_path / "s"
    train_head(target_dir, straight, tmp_path / "f", TINY, progress=False)
    a, b = DraftHead.load(out).state_dict(), DraftHead.load(straight).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_of_other_settings_is_not_resumed(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changing the recipe between runs trains from scratch rather than mixing the two."""
    out = tmp_path / "h"
    with monkeypatch.context() as patched:
        interrupted_after(patched, 2)
        with pytest.raises(KeyboardInterrupt):
            train_head(target_dir, out, tmp_path / "f", TINY, progress=False)
    other = attrs.evolve(TINY, train=attrs.evolve(TINY.train, lr=1e-3))
    assert train_head(target_dir, out, tmp_path / "f", other, progress=False).resumed_from_step == 0


def test_cache_rebuilds_an_incomplete_entry(target_dir: Path, cache: Path) -> None:
    """A cache entry without the marker is never used: it is discarded and rebuilt; a
    complete one is reused."""
    entry = head_dir(target_dir, "tiny", TINY)
    assert entry.parent == cache / "drafts"
    entry.mkdir(parents=True)
    (entry / "head.json").write_text("{}")
    (entry / "junk").write_text("half-written")
    with pytest.raises(HeadNotFound, match="not a finished draft head"):
        resolve_head(str(entry))
    assert cached_head(target_dir, "tiny", TINY, progress=False) == entry
    assert (entry / MARKER).is_file() and not (entry / "junk").exists()
    stamp = (entry / MARKER).stat().st_mtime_ns
    assert cached_head(target_dir, "tiny", TINY, progress=False) == entry
    assert (entry / MARKER).stat().st_mtime_ns == stamp
    assert resolve_head(str(entry)) == entry


def test_resolve_head_names_and_missing(
    target_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``smollm2-head`` finds the cached head; a missing one names the command to run."""
    monkeypatch.setattr(head_cache, "resolve_model", lambda name, progress: target_dir)
    with pytest.raises(HeadNotFound, match="shard draft train --target smollm2"):
        resolve_head("smollm2-head")
    with pytest.raises(HeadNotFound, match="not a head directory or a head name"):
        resolve_head("nonsense-head")
    entry = head_dir(target_dir, "smollm2", HeadRecipe())
    entry.mkdir(parents=True)
    (entry / MARKER).write_text("{}")
    (entry / "head.json").write_text("{}")
    assert resolve_head("smollm2-head") == entry


def test_resolve_head_builds_when_asked(
    target_dir: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``build=True`` trains the missing head, saying so first."""
    monkeypatch.setattr(head_cache, "resolve_model", lambda name, progress: target_dir)
    monkeypatch.setattr(head_cache, "HeadRecipe", lambda: TINY)
    got = resolve_head("smollm2-head", build=True, progress=False)
    assert got == head_dir(target_dir, "smollm2", TINY) and (got / MARKER).is_file()
    assert "building the draft head 'smollm2-head'" in capsys.readouterr().err


def test_cli_draft_train_and_path(
    target_dir: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard draft train --out` builds and reports α and cost; `path` fails clearly."""
    out = tmp_path / "h"
    argv = ["draft", "train", "--target", str(target_dir), "--shortlist", "64", "--steps", "3"]
    assert cli_main([*argv, "--out", str(out), "--no-progress", "--minutes", "0.02"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: α1..α4" in said and "ms per drafted token" in said
    assert 1 <= json.loads((out / MARKER).read_text())["steps"] <= 3
    assert cli_main(["draft", "path", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert cli_main(["draft", "path", "nonsense-head"]) == 2
    assert "shard draft: error:" in capsys.readouterr().err
    assert cli_main(["draft", "train", "--minutes", "x"]) == 2


def test_measured_acceptance_counts_chains(target_dir: Path) -> None:
    """Acceptance is scored at every start of the continuation, through the proposer: α in
    [0, 1], and a verify of more drafts never commits fewer tokens."""
    target = load_stage(target_dir, 0, 4)
    head = DraftHead.from_target(target, shortlist=None)
    ids = torch.randint(0, target.config.vocab_size, (1, 30), generator=torch.Generator())
    refs = reference_features(target, [(ids[0, :10].tolist(), ids[0, 10:].tolist())])
    starts, alpha, committed = chained_acceptance(head, refs)
    assert starts == 20 and len(alpha) == 4  # m = 9..28: x_{m+1} in the continuation
    assert all(0 <= a <= 1 for a in alpha) and all(c >= 1 for c in committed)
    assert list(committed) == sorted(committed)


def test_sigterm_interrupts_training_like_ctrl_c() -> None:
    """Inside the command, SIGTERM raises ``KeyboardInterrupt`` (so training checkpoints);
    outside it, the previous handler is back."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), head_cli._sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before


def test_cli_interrupted_says_how_to_resume(
    target_dir: Path,
    tmp_path: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An interrupted `shard draft train` exits 130 and says that rerunning resumes."""

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(head_cli, "train_head", interrupted)
    argv = ["draft", "train", "--target", str(target_dir), "--out", str(tmp_path / "h")]
    assert cli_main(argv) == 130
    assert "run the same command again to resume" in capsys.readouterr().err

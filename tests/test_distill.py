"""Distilled drafts: training forward, target labels, training, checkpoint, cache, CLI.

Everything runs on tiny random checkpoints (4-layer target, 1-layer draft), in seconds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch

from shard.cli import main as cli_main
from shard.decode.draft import ModelProposer
from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import load_stage, load_truncated
from shard.model.tokenizer import Tokenizer
from shard.training.distill import build as distill_mod
from shard.training.distill import cache as draft_cache
from shard.training.distill.build import MARKER, DistillError, distill, write_checkpoint
from shard.training.distill.cache import (
    DraftNotFound,
    Recipe,
    cached_draft,
    draft_dir,
    resolve_draft,
)
from shard.training.distill.data import Corpus, hidden_states, labelled_samples, seed_prompts
from shard.training.distill.train import Objective, agreement, mean_kl, reference_runs, train

TINY_RECIPE = Recipe(layers=1, steps=3, seq_len=96, batch=4, seed=0, time_budget_s=None)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and OpenMP spin-waits stall a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def target_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(n_layers=4)


@pytest.fixture
def target(target_dir: Path) -> StageModel:
    return load_stage(target_dir, 0, 4)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points ``cache_dir()`` at a temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "shard"


def samples(target: StageModel, target_dir: Path, rows: int, seed: int) -> Corpus:
    tok = Tokenizer.from_dir(target_dir)
    prompts = [p[-40:] for p in seed_prompts(tok, rows, random.Random(seed))]
    gen = torch.Generator().manual_seed(seed)
    return labelled_samples(
        target, prompts, seq_len=96, temperature=1.0, stop_ids=tok.eos_ids, generator=gen
    )


def test_training_forward_matches_inference(target: StageModel) -> None:
    """The cache-free training forward gives the logits of ``StageModel.forward``."""
    ids = torch.randint(0, target.config.vocab_size, (2, 24), generator=torch.Generator())
    assert target.lm_head is not None
    with torch.inference_mode():
        got = target.lm_head(hidden_states(target, ids))
        want = target(ids, 0, target.new_cache(24, batch=2))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sampled_labels_are_the_targets_hidden_states(target: StageModel, target_dir: Path) -> None:
    """Labels of left-padded batch sampling equal an unpadded forward over each row."""
    corpus = samples(target, target_dir, rows=3, seed=1)
    with torch.inference_mode():
        again = hidden_states(target, corpus.ids)
    assert corpus.valid[:, 0].all() and corpus.tokens > 3 * 40
    torch.testing.assert_close(again[corpus.valid], corpus.labels[corpus.valid], rtol=0, atol=1e-3)


@pytest.mark.parametrize("objective", ["ce", "kl"])
def test_training_lowers_kl_and_does_not_lower_agreement(
    target: StageModel, target_dir: Path, objective: Objective
) -> None:
    """A few steps on target samples lower held-out KL; greedy agreement does not drop."""
    tok = Tokenizer.from_dir(target_dir)
    train_set, held_out = samples(target, target_dir, 16, seed=2), samples(target, target_dir, 4, 3)
    runs = reference_runs(target, tok, tokens=32)
    draft = load_truncated(target_dir, 1)
    kl_before = mean_kl(draft, held_out)
    hits_before, _ = agreement(lambda n: ModelProposer(draft, max_len=n), runs)
    losses = train(draft, train_set, steps=40, batch=8, seed=0, lr=3e-3, objective=objective)
    kl_after = mean_kl(draft, held_out)
    hits_after, _ = agreement(lambda n: ModelProposer(draft, max_len=n), runs)
    print(
        f"{objective}: KL {kl_before:.3f} -> {kl_after:.3f}; hits {hits_before} -> "
        f"{hits_after}; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    assert kl_after < (0.95 if objective == "ce" else 0.85) * kl_before
    assert hits_after >= hits_before
    assert not any(p.requires_grad for p in draft.parameters())


def test_written_draft_loads_as_a_checkpoint(target_dir: Path, tmp_path: Path) -> None:
    """``write_checkpoint`` output loads with ``load_stage`` and computes the same logits."""
    draft = load_truncated(target_dir, 1)
    out = tmp_path / "draft"
    out.mkdir()
    write_checkpoint(draft, target_dir, out)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert ModelConfig.from_dir(out).n_layers == 1
    assert Tokenizer.from_dir(out).encode("the cat") == Tokenizer.from_dir(target_dir).encode(
        "the cat"
    )
    loaded = load_stage(out, 0, 1)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded(ids, 0, loaded.new_cache(8)), draft(ids, 0, draft.new_cache(8))
        )


def test_distill_publishes_a_complete_draft(target_dir: Path, tmp_path: Path) -> None:
    """``distill`` writes a loadable draft with ``distill.json``; an existing output is refused."""
    out = tmp_path / "d"
    report = distill(target_dir, out, progress=False, **attrs.asdict(TINY_RECIPE))
    marker = json.loads((out / MARKER).read_text())
    assert marker["layers"] == 1 and marker["measured"]["alpha"] == report.measured.alpha
    assert 0.0 <= report.measured.alpha <= 1.0 and report.measured.positions > 0
    assert load_stage(out, 0, 1).config.n_layers == 1
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary left behind
    with pytest.raises(DistillError, match="already exists"):
        distill(target_dir, out, progress=False, **attrs.asdict(TINY_RECIPE))


def test_failed_distill_leaves_nothing(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash while writing leaves neither the output nor a temporary directory."""

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(distill_mod, "write_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        distill(target_dir, tmp_path / "d", progress=False, **attrs.asdict(TINY_RECIPE))
    assert list(tmp_path.iterdir()) == []


def test_cache_rebuilds_an_entry_without_marker(target_dir: Path, cache: Path) -> None:
    """A cache entry without the marker is never used: it is discarded and rebuilt."""
    entry = draft_dir(target_dir, "tiny", 1)
    assert entry.parent == cache / "drafts"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    (entry / "junk").write_text("half-written")
    got = cached_draft(target_dir, "tiny", TINY_RECIPE, progress=False)
    assert got == entry and (entry / MARKER).is_file() and not (entry / "junk").exists()
    stamp = (entry / MARKER).stat().st_mtime_ns
    assert cached_draft(target_dir, "tiny", TINY_RECIPE, progress=False) == entry
    assert (entry / MARKER).stat().st_mtime_ns == stamp  # a complete entry is reused
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_resolve_draft_names_paths_and_missing(
    target_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names find cached drafts; a missing one says to run `shard draft distill`."""
    monkeypatch.setattr(draft_cache, "resolve_model", lambda name, progress: target_dir)
    with pytest.raises(DraftNotFound, match="shard draft distill --target smollm2 --layers 3"):
        resolve_draft("smollm2-distilled-3L")
    with pytest.raises(DraftNotFound, match="not a checkpoint directory or a distilled"):
        resolve_draft("nonsense")
    assert resolve_draft(str(target_dir)) == target_dir
    entry = draft_dir(target_dir, "smollm2", 3)
    entry.mkdir(parents=True)
    (entry / MARKER).write_text("{}")
    assert resolve_draft("smollm2-distilled-3L") == entry


def test_cli_draft_distill_and_path(
    target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard draft distill --out` builds and reports α; `shard draft path` fails clearly."""
    out = tmp_path / "d"
    argv = ["draft", "distill", "--target", str(target_dir), "--layers", "1", "--steps", "2"]
    assert cli_main([*argv, "--out", str(out), "--no-progress", "--minutes", "1"]) == 0
    assert f"wrote {out}: α" in capsys.readouterr().out
    assert cli_main(["draft", "path", "nonsense"]) == 2
    assert "shard draft: error:" in capsys.readouterr().err
    assert cli_main(["draft", "distill", "--layers", "x"]) == 2

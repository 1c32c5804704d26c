"""The features cache: target-labelled text for training heads, made once and kept on disk.

Text and features come from ``shard.training.distill.data.build_corpus`` (the target's own
samples of varied prompts, plus standard-library code), made in *chunks* of a few dozen
rows. Each chunk is written to a temporary name and renamed into place, and only then added
to ``features.json``; so an interrupted run loses at most the chunk it was making, and a
rerun (or a head trained with other settings) reuses everything already made. A chunk holds
the rows' ids, features (fp16: half the disk, and a head trains on fp32 copies), loss mask,
and the target's greedy token at every position (``train.greedy_targets``).

``features.json`` records which chunks are complete and the seconds they took; a chunk file
it does not list (a crash mid-write) is ignored, and a listed one that cannot be read is
dropped and made again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from shard.model.llama import StageModel
from shard.model.tokenizer import Tokenizer
from shard.training.distill.data import Corpus, build_corpus
from shard.training.head.train import greedy_targets

__all__ = ["FEATURES_VERSION", "MANIFEST", "FeatureStore", "Features"]

FEATURES_VERSION = 1
MANIFEST = "features.json"


class Features:
    """A loaded corpus: ``corpus`` (fp32 features) and the target's greedy tokens ``[N, S]``."""

    def __init__(self, corpus: Corpus, greedy: Tensor) -> None:
        self.corpus = corpus
        self.greedy = greedy


class FeatureStore:
    """The chunks of one target's features under ``root`` (created on first write)."""

    def __init__(self, root: Path, *, seq_len: int, seed: int, rows_per_chunk: int) -> None:
        self.root = Path(root)
        self.seq_len = seq_len
        self.seed = seed
        self.rows_per_chunk = rows_per_chunk
        self._manifest = self._read_manifest()

    @property
    def seconds(self) -> float:
        """Seconds spent making the chunks held (what a data budget is counted against)."""
        return float(sum(c["seconds"] for c in self._manifest["chunks"]))

    @property
    def tokens(self) -> int:
        return int(sum(c["tokens"] for c in self._manifest["chunks"]))

    def fill(
        self,
        target: StageModel,
        tokenizer: Tokenizer,
        budget_s: float,
        *,
        chunks: int | None = None,
        progress: bool,
        sampler: StageModel | None = None,
    ) -> None:
        """Make chunks until they hold ``budget_s`` seconds of work (at least one chunk).

        ``sampler`` (default: ``target``) samples the text and computes its features, e.g.
        a bf16 copy of the target (1.8x the text per budget on a CPU with bf16
        instructions); the greedy labels always come from ``target``'s own head applied to
        those features.

        Stops early when the next chunk would overrun the budget by more than half its
        expected time, so a budget is met to within about half a chunk. ``chunks``, when
        given, replaces the budget: the cache is filled to exactly that many chunks, however
        long they take, so that the same target and seed give the same data on any machine.
        """
        bar = tqdm(
            total=round(budget_s),
            initial=min(round(self.seconds), round(budget_s)),
            desc="sampling features",
            unit="s",
            disable=not progress,
        )
        try:
            while self._wants_another(budget_s, chunks):
                began = time.perf_counter()
                index = self._next_index()
                chunk = self._make_chunk(target, tokenizer, index, sampler or target)
                seconds = time.perf_counter() - began
                self._add(index, chunk, seconds)
                bar.set_postfix(tokens=self.tokens, refresh=False)
                bar.update(min(round(seconds), max(round(budget_s) - bar.n, 0)))
        finally:
            bar.close()

    def load(self, chunks: int | None = None) -> Features:
        """Every complete chunk (or the first ``chunks`` of them), concatenated (features as
        fp32)."""
        ids, labels, valid, greedy = [], [], [], []
        entries = sorted(self._manifest["chunks"], key=lambda c: int(c["index"]))
        for entry in entries[:chunks]:
            t = load_file(str(self.root / entry["file"]))
            ids.append(t["ids"])
            labels.append(t["labels"].float())
            valid.append(t["valid"])
            greedy.append(t["greedy"])
        if not ids:
            raise ValueError(f"no features under {self.root}")
        corpus = Corpus(torch.cat(ids), torch.cat(labels), torch.cat(valid))
        return Features(corpus, torch.cat(greedy))

    # -- internals -------------------------------------------------------------------------

    def _wants_another(self, budget_s: float, count: int | None) -> bool:
        held = len(self._manifest["chunks"])
        if count is not None:
            return held < count
        return held == 0 or self._room_for_another(budget_s)

    def _room_for_another(self, budget_s: float) -> bool:
        chunks = self._manifest["chunks"]
        expected = self.seconds / len(chunks)
        return self.seconds + expected / 2 < budget_s

    def _next_index(self) -> int:
        return max((int(c["index"]) for c in self._manifest["chunks"]), default=-1) + 1

    def _make_chunk(
        self, target: StageModel, tokenizer: Tokenizer, index: int, sampler: StageModel
    ) -> dict[str, Any]:
        seed = self.seed * 1_000_003 + index  # every chunk its own prompts and draws
        corpus = build_corpus(
            sampler, tokenizer, self.rows_per_chunk, self.seq_len, seed, None, False
        )
        return {
            "ids": corpus.ids.contiguous(),
            "labels": corpus.labels.to(torch.float16).contiguous(),
            "valid": corpus.valid.contiguous(),
            "greedy": greedy_targets(target, corpus).contiguous(),
            "tokens": corpus.tokens,
        }

    def _add(self, index: int, chunk: dict[str, Any], seconds: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"chunk-{index:05d}.safetensors"
        tmp = self.root / f".{name}.tmp"
        tokens = int(chunk.pop("tokens"))
        save_file(chunk, str(tmp))
        os.replace(tmp, self.root / name)
        self._manifest["chunks"].append(
            {"index": index, "file": name, "tokens": tokens, "seconds": round(seconds, 2)}
        )
        _write_json(self.root / MANIFEST, self._manifest)

    def _fresh(self) -> dict[str, Any]:
        return {
            "features_version": FEATURES_VERSION,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "rows_per_chunk": self.rows_per_chunk,
            "chunks": [],
        }

    def _read_manifest(self) -> dict[str, Any]:
        """The manifest, keeping only chunks that exist and read back whole."""
        fresh = self._fresh()
        try:
            d = json.loads((self.root / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return fresh
        if not isinstance(d, dict) or any(d.get(k) != v for k, v in fresh.items() if k != "chunks"):
            return fresh  # another layout or version: start over (old chunks get overwritten)
        kept = []
        for entry in d.get("chunks", []):
            try:
                path = self.root / str(entry["file"])
                t = load_file(str(path))
                ok = {"ids", "labels", "valid", "greedy"} <= t.keys()
                ok = ok and tuple(t["ids"].shape[1:]) == (self.seq_len,)
                if ok:
                    kept.append(
                        {
                            "index": int(entry["index"]),
                            "file": path.name,
                            "tokens": int(entry["tokens"]),
                            "seconds": float(entry["seconds"]),
                        }
                    )
            except (OSError, KeyError, TypeError, ValueError, SafetensorError):
                continue
        fresh["chunks"] = kept
        return fresh


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

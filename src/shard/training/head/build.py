"""``train_head``: a draft head for a target, end to end, resumable, inside a time budget.

    features   ``FeatureStore.fill`` until the cache holds ``data_share`` of the budget's
               worth of target-labelled text (reused, and extended, by later runs), or
               exactly ``data_chunks`` chunks of it (the same data on every machine)
    train      ``Trainer``: AdamW on ``train.head_loss``; a checkpoint every
               ``checkpoint_every`` steps and when interrupted (Ctrl-C, SIGTERM), from which
               the next run resumes
    measure    ``measure.measure_head``: chained α on held-out prompts through the
               proposer, and ms per drafted token against the target's ms per token
    publish    the head in a temporary sibling of ``out_dir``, ``MARKER`` written last,
               renamed into place; the training state is then deleted (the features stay)

The budget covers features and training: training gets what the features' share leaves,
counted in training seconds across resumes, so an interrupted run finishes the same
schedule when run again. Measuring adds about a minute on SmolLM2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from shard.decode.head.model import HEAD_VERSION, DraftHead, HeadError
from shard.model.config import ModelConfig
from shard.model.device import cpu_has_bf16, torch_dtype
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.head.features import FeatureStore
from shard.training.head.measure import Measured, measure_head
from shard.training.head.train import shortlist_from
from shard.training.head.trainer import Trainer, TrainSettings

__all__ = ["MARKER", "HeadExists", "HeadRecipe", "HeadReport", "train_head"]

MARKER = "train.json"
"""Settings, training record and measurements; written last, so its presence means whole."""


class HeadExists(HeadError):
    """The output directory appeared while training (a concurrent run published first)."""


SAMPLE_DTYPES = ("auto", "float32", "bfloat16")


@attrs.frozen
class HeadRecipe:
    """How to train a head (what ``train_head`` takes besides paths and hooks)."""

    minutes: float = 20.0
    data_share: float = 0.6
    layers: int = 1
    window: int = 64
    shortlist: int = 8192
    seq_len: int = 192
    rows_per_chunk: int = 80
    seed: int = 0
    data_chunks: int | None = None  # exactly this many feature chunks; None: the data budget
    #: The dtype of the target copy that samples the text and its features: "auto" is
    #: bfloat16 on a CPU with bf16 instructions (1.8x the text per budget here), else
    #: float32. Training and measuring always use the fp32 target.
    sample_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(SAMPLE_DTYPES))
    train: TrainSettings = attrs.field(factory=TrainSettings)

    @property
    def budget_s(self) -> float:
        return self.minutes * 60

    def sampling_dtype(self) -> str:
        """``sample_dtype`` with "auto" resolved on this machine."""
        if self.sample_dtype != "auto":
            return self.sample_dtype
        return "bfloat16" if cpu_has_bf16() else "float32"

    def data_budget_s(self) -> float:
        return self.data_share * self.budget_s

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "sampling_dtype": self.sampling_dtype()}


@attrs.frozen
class HeadReport:
    """What ``train_head`` built and how well it drafts.

    Times add up over every run that contributed (an interrupted run and its resumption):
    ``data_s`` made the features, ``train_s`` ran training steps (``train_wall_s`` with
    checkpoints and progress), ``measure_s`` measured; ``wall_s`` is their sum plus this
    run's loading of the target. Features an earlier head already made count in full.
    """

    out_dir: str
    target: str
    recipe: dict[str, Any]
    feature_tokens: int
    feature_rows: int
    data_s: float
    train_s: float
    steps: int
    positions_trained: int
    resumed_from_step: int
    loss_first: float
    loss_last: float
    train_wall_s: float
    measure_s: float
    wall_s: float
    threads: int
    load_average: float
    measured: Measured

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["head_version"] = HEAD_VERSION
        return d


def work_dir_for(out_dir: Path) -> Path:
    """Where an output's training state lives until it is published: a hidden sibling."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.train"


def train_head(
    target_dir: Path,
    out_dir: Path,
    features_dir: Path,
    recipe: HeadRecipe,
    *,
    progress: bool,
) -> HeadReport:
    """Train a head for the model in ``target_dir`` and publish it as ``out_dir``.

    ``features_dir``: the features cache (shared by every head of this target and seed).

    Errors: ``HeadError`` when ``out_dir`` exists; ``HeadExists`` when a concurrent run
    published it first. An interrupt (``KeyboardInterrupt``) leaves a checkpoint behind.

    Longer than the house limit on purpose, like ``distill``: it is the recipe read top to
    bottom, and most of its lines are the report's fields.
    """
    began = time.perf_counter()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.exists():
        raise HeadError(f"{out_dir} already exists; remove it or choose another directory")
    n_layers = ModelConfig.from_dir(target_dir).n_layers
    # Dense weights: the head copies the target's embedding and head matrices (a stored
    # checkpoint's tensors dequantized exactly).
    target = load_stage(target_dir, 0, n_layers, weights="float32")
    dtype = recipe.sampling_dtype()
    sampler = (
        None
        if dtype == "float32"
        else load_stage(target_dir, 0, n_layers, dtype=torch_dtype(dtype), weights=dtype)
    )
    tokenizer = Tokenizer.from_dir(target_dir)
    store = FeatureStore(
        features_dir, seq_len=recipe.seq_len, seed=recipe.seed, rows_per_chunk=recipe.rows_per_chunk
    )
    setup_s = time.perf_counter() - began  # loading the target (this run's; a few seconds)
    store.fill(
        target,
        tokenizer,
        recipe.data_budget_s(),
        chunks=recipe.data_chunks,
        progress=progress,
        sampler=sampler,
    )
    del sampler  # training needs the memory more
    data = store.load(recipe.data_chunks)
    shortlist = None
    if recipe.shortlist:
        eos = tokenizer.eos_ids
        shortlist = shortlist_from(data.greedy, data.corpus.valid, recipe.shortlist, eos)
    head = DraftHead.from_target(
        target, layers=recipe.layers, window=recipe.window, shortlist=shortlist, seed=recipe.seed
    )
    work = work_dir_for(out_dir)
    fingerprint = {"recipe": recipe.to_json(), "rows": int(data.corpus.ids.shape[0])}
    trainer = Trainer(head, data, recipe.train, work, seed=recipe.seed, fingerprint=fingerprint)
    train_budget = max(recipe.budget_s - recipe.data_budget_s(), 0.0)
    record = trainer.run(train_budget, progress=progress)
    if progress:
        print("measuring the head on held-out prompts (about a minute)", file=sys.stderr)
    measure_began = time.perf_counter()
    measured = measure_head(target, tokenizer, head)
    measure_s = time.perf_counter() - measure_began
    report = HeadReport(
        out_dir=str(out_dir),
        target=str(target_dir),
        recipe=recipe.to_json(),
        feature_tokens=data.corpus.tokens,
        feature_rows=int(data.corpus.ids.shape[0]),
        data_s=round(store.seconds, 1),
        train_s=round(record.train_s, 1),
        steps=record.steps,
        positions_trained=record.positions,
        resumed_from_step=record.resumed_from,
        loss_first=round(record.loss_first, 4),
        loss_last=round(record.loss_last, 4),
        train_wall_s=round(record.wall_s, 1),
        measure_s=round(measure_s, 1),
        wall_s=round(setup_s + store.seconds + record.wall_s + measure_s, 1),
        threads=torch.get_num_threads(),
        load_average=round(os.getloadavg()[0], 2),
        measured=measured,
    )
    _publish(head, report, out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return report


def _publish(head: DraftHead, report: HeadReport, out: Path) -> None:
    """Write the head into a temporary sibling of ``out``, ``MARKER`` last, and rename it
    into place; renaming onto an existing directory fails (``HeadExists``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared cache entry private
        head.save(tmp)
        with (tmp / MARKER).open("w", encoding="utf-8") as f:
            f.write(json.dumps(report.to_json(), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if out.exists():
                raise HeadExists(f"{out} appeared while training; keeping it") from exc
            raise HeadError(f"could not move the head into {out}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Distil a small draft model from the target, offline, in minutes, on a CPU.

The draft is the target's first ``layers`` layers plus its final norm and (tied) embedding
and head, so it shares the target's tokenizer and embedding; the layers and the norm are then
trained to imitate the whole target (knowledge distillation). The work is split by idea:

    data.py     training text (the target's own samples, stdlib code), target labels
    train.py    the loss and training loop; ``measure``, the held-out agreement check
    build.py    ``distill``: the recipe end to end and the checkpoint it publishes
    cache.py    where drafts live, ``cached_draft`` and ``resolve_draft``
    cli.py      ``shard draft {distill,path}``

The result is an ordinary Hugging Face checkpoint directory (``load_stage(dir, 0, layers)``,
``[speculation] draft_model = "dir"``) whose ``distill.json`` records the settings and the
measured agreement. It is built in a temporary sibling and renamed into place with
``distill.json`` written last, so a directory without it is never a draft.
``cache.resolve_draft("smollm2-distilled")`` finds a built draft in the cache; building it takes
minutes, so it happens only on request (``shard draft distill``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import hf_name, load_stage, load_truncated
from shard.model.tokenizer import Tokenizer
from shard.training.distill.data import build_corpus
from shard.training.distill.train import Measured, measure, reference_runs, train

__all__ = [
    "MARKER",
    "DistillError",
    "DistillReport",
    "DraftExists",
    "distill",
    "write_checkpoint",
]

DISTILL_VERSION = 1
"""Bumped whenever training changes what a draft is, so cached drafts are rebuilt."""

MARKER = "distill.json"
"""Settings and measured agreement; written last, so its presence means the directory is whole."""

_DATA_SHARE = 0.5  # of a time budget, at most, for sampling and labelling text
_EPOCHS = 4  # the corpus is ``steps * batch / _EPOCHS`` rows


class DistillError(Exception):
    """A draft cannot be distilled or found; the message says what to do."""


@attrs.frozen
class DistillReport:
    """What ``distill`` built, how, and how well it agrees with its target."""

    out_dir: Path
    target: str
    layers: int
    steps: int
    seq_len: int
    batch: int
    seed: int
    time_budget_s: float | None
    threads: int
    rows: int
    train_tokens: int
    data_s: float
    train_s: float
    loss_first: float
    loss_last: float
    measured: Measured

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["distill_version"] = DISTILL_VERSION
        return d


def distill(
    target_dir: Path,
    out_dir: Path,
    *,
    layers: int,
    steps: int,
    seq_len: int,
    batch: int,
    seed: int,
    progress: bool,
    time_budget_s: float | None,
) -> DistillReport:
    """Train a ``layers``-layer draft of the model in ``target_dir``; publish it as ``out_dir``.

    ``time_budget_s`` caps sampling plus training (the learning-rate schedule follows
    whichever of steps and time runs out first); measuring adds about a minute for SmolLM2.
    ``out_dir`` is built in a temporary sibling and renamed into place with ``MARKER`` written last.

    Errors: ``DistillError`` when ``out_dir`` exists or the layer count is out of range.

    Longer than the house limit on purpose: it is the recipe, read top to bottom (load, label,
    train, measure, publish), and most of its lines are the report's fields; cut into pieces
    it would only pass the same dozen values between them.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.exists():
        raise DistillError(f"{out_dir} already exists; remove it or choose another directory")
    # Dense float32 throughout: the student trains by gradients, and labels and student share
    # one arithmetic (a stored checkpoint's tensors dequantized exactly).
    n_layers = ModelConfig.from_dir(target_dir).n_layers
    target = load_stage(target_dir, 0, n_layers, weights="float32")
    if not 0 < layers < target.config.n_layers:
        raise DistillError(f"a draft needs 1..{target.config.n_layers - 1} layers, got {layers}")
    tokenizer = Tokenizer.from_dir(target_dir)
    torch.manual_seed(seed)
    began = time.perf_counter()
    data_budget = None if time_budget_s is None else _DATA_SHARE * time_budget_s
    rows = max(batch, steps * batch // _EPOCHS)
    corpus = build_corpus(target, tokenizer, rows, seq_len, seed, data_budget, progress)
    data_s = time.perf_counter() - began
    student = load_truncated(target_dir, layers, weights="float32")
    train_budget = None if time_budget_s is None else max(time_budget_s - data_s, 0.0)
    losses = train(
        student,
        corpus,
        steps=steps,
        batch=batch,
        seed=seed,
        budget_s=train_budget,
        progress=progress,
    )
    train_s = time.perf_counter() - began - data_s
    baseline = load_truncated(target_dir, layers, weights="float32")
    report = DistillReport(
        out_dir=out_dir,
        target=str(target_dir),
        layers=layers,
        steps=len(losses),
        seq_len=seq_len,
        batch=batch,
        seed=seed,
        time_budget_s=time_budget_s,
        threads=torch.get_num_threads(),
        rows=int(corpus.ids.shape[0]),
        train_tokens=corpus.tokens,
        data_s=round(data_s, 1),
        train_s=round(train_s, 1),
        loss_first=round(losses[0], 4),
        loss_last=round(sum(losses[-10:]) / len(losses[-10:]), 4),
        measured=measure(target, student, baseline, reference_runs(target, tokenizer)),
    )
    _publish(target_dir, student, report)
    return report


class DraftExists(DistillError):
    """The output directory appeared while distilling (a concurrent run published first)."""


def _publish(target_dir: Path, student: StageModel, report: DistillReport) -> None:
    """Write the checkpoint into a temporary sibling of ``report.out_dir``, ``MARKER`` last,
    and rename it into place; renaming onto an existing directory fails (``DraftExists``)."""
    out = report.out_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared cache entry private
        write_checkpoint(student, target_dir, tmp)
        _write_json(tmp / MARKER, report.to_json())
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if out.exists():
                raise DraftExists(f"{out} appeared while distilling; keeping it") from exc
            raise DistillError(f"could not move the draft into {out}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_checkpoint(model: StageModel, target_dir: Path, out_dir: Path) -> None:
    """``model`` (every layer) as a checkpoint in ``out_dir``: the target's config.json with
    ``num_hidden_layers`` changed, ``model.safetensors``, and its tokenizer files."""
    config = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = len(model.layers)
    _write_json(out_dir / "config.json", config)
    tensors = {  # named_parameters lists a tied head once, as the embedding
        hf_name(model.config, 0, name): p.detach().contiguous()
        for name, p in model.named_parameters()
    }
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors writes 0600; a cache entry is shared like the model
    _fsync(weights)
    for f in sorted(target_dir.iterdir()):
        if f.is_file() and _is_tokenizer_file(f.name):
            shutil.copyfile(f, out_dir / f.name)


def _is_tokenizer_file(name: str) -> bool:
    """Whatever the target holds besides weights, config and markers (tokenizer, chat
    template, generation config)."""
    ours = name in ("config.json", MARKER) or name.startswith(("shard-", "."))
    return not ours and not name.endswith((".safetensors", ".safetensors.index.json", ".gguf"))


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())

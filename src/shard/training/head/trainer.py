"""``Trainer``: the head's training loop, checkpointed so an interrupted run resumes.

Everything random is a function of the seed and the step (the rows of step ``s``, its
noise and its scored positions), so a resumed run draws what the uninterrupted one would
have. The learning-rate schedule follows the training seconds spent, which the checkpoint
carries across runs.

A checkpoint is a directory ``ckpt-<step>`` under the work directory: the head
(``DraftHead.save``), the optimizer's moments (``optim.safetensors``) and ``state.json``,
written last. Loading takes the newest one with a ``state.json``; writing a new one removes
the older ones. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from shard.decode.head.model import DraftHead, HeadError
from shard.training.head.features import Features
from shard.training.head.train import head_loss, index_in, lr_at

__all__ = ["TrainRecord", "TrainSettings", "Trainer"]

_STATE = "state.json"


@attrs.frozen
class TrainSettings:
    """The optimizer and loss settings (``train.head_loss`` documents the loss)."""

    batch: int = 8
    lr: float = 3e-3
    passes: int = 1
    noise: float = 0.1
    reg_weight: float = 1.0
    soft: float = 0.7
    weight_decay: float = 0.05
    ce_positions: int = 384
    checkpoint_every: int = 50
    max_steps: int | None = None  # None: the time budget alone ends training


@attrs.frozen
class TrainRecord:
    """How training went, across every run that contributed to it."""

    steps: int
    train_s: float
    wall_s: float
    positions: int
    resumed_from: int
    loss_first: float
    loss_last: float


class Trainer:
    """Trains ``head`` in place on ``data``; checkpoints under ``work`` (see the module)."""

    def __init__(
        self,
        head: DraftHead,
        data: Features,
        settings: TrainSettings,
        work: Path,
        *,
        seed: int,
        fingerprint: dict[str, Any],
    ) -> None:
        self.head = head
        self._data = data
        self._s = settings
        self._work = Path(work)
        self._seed = seed
        self._fingerprint = fingerprint  # a checkpoint of other settings is not resumed
        self._table = index_in(head.shortlist, head.config.target.vocab_size)
        self._params = head.trainable()
        self._opt = torch.optim.AdamW(
            self._params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
        )
        self._perms: dict[int, Tensor] = {}
        self.step = 0
        self.train_s = self.wall_s = 0.0
        self.positions = 0
        self.losses: list[float] = []

    def resume(self) -> bool:
        """Load the newest readable checkpoint, if it is of the same settings."""
        for ckpt in sorted(self._work.glob("ckpt-*"), reverse=True):
            try:
                state = json.loads((ckpt / _STATE).read_text(encoding="utf-8"))
                if state.get("fingerprint") != self._fingerprint:
                    return False  # another recipe's: train afresh (``save`` replaces it)
                saved = DraftHead.load(ckpt)
                moments = load_file(str(ckpt / "optim.safetensors"))
                step, train_s = int(state["step"]), float(state["train_s"])
                wall_s, positions = float(state["wall_s"]), int(state["positions"])
                losses = [float(x) for x in state["losses"]]
            except (OSError, KeyError, TypeError, ValueError, SafetensorError, HeadError):
                continue  # a damaged checkpoint: try the one before it
            self.head.load_state_dict(saved.state_dict())
            self.head.shortlist = saved.shortlist
            self._table = index_in(saved.shortlist, self.head.config.target.vocab_size)
            self._load_moments(moments)
            self.step, self.train_s, self.wall_s = step, train_s, wall_s
            self.positions, self.losses = positions, losses
            return True
        return False

    def run(
        self,
        budget_s: float,
        *,
        progress: bool,
    ) -> TrainRecord:
        """Train until ``budget_s`` training seconds (or ``max_steps``) are spent, resuming
        from a checkpoint when there is one; checkpoint on the way and when interrupted."""
        resumed_from = self.step if self.resume() else 0
        began = time.perf_counter()
        wall0 = self.wall_s
        bar = tqdm(
            total=round(budget_s),
            initial=min(round(self.train_s), round(budget_s)),
            desc="training head",
            unit="s",
            disable=not progress,
        )
        for p in self._params:
            p.requires_grad_(True)
        self.head.train()
        saved_at = self.step
        try:
            while self._fraction_done(budget_s) < 1.0 or self.step == 0:
                t0 = time.perf_counter()
                loss, accuracy = self._one_step(budget_s)
                self.train_s += time.perf_counter() - t0
                self.wall_s = wall0 + time.perf_counter() - began
                self.losses.append(loss)
                self.step += 1
                bar.set_postfix(
                    step=self.step, loss=f"{loss:.3f}", top1=f"{accuracy:.2f}", refresh=False
                )
                bar.update(min(round(self.train_s), round(budget_s)) - bar.n)
                if self.step % self._s.checkpoint_every == 0:
                    self.save()
                    saved_at = self.step
        except BaseException:
            if self.step > saved_at:
                self.save()
            raise
        finally:
            bar.close()
            for p in self._params:
                p.requires_grad_(False)
            self.head.eval()
        tail = self.losses[-20:]
        return TrainRecord(
            steps=self.step,
            train_s=self.train_s,
            wall_s=self.wall_s,
            positions=self.positions,
            resumed_from=resumed_from,
            loss_first=self.losses[0],
            loss_last=sum(tail) / len(tail),
        )

    def save(self) -> None:
        """Write ``ckpt-<step>`` (``state.json`` last) and remove older checkpoints."""
        self._work.mkdir(parents=True, exist_ok=True)
        ckpt = self._work / f"ckpt-{self.step:08d}"
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir()
        self.head.save(ckpt)
        save_file(self._moments(), str(ckpt / "optim.safetensors"))
        state = {
            "fingerprint": self._fingerprint,
            "step": self.step,
            "train_s": self.train_s,
            "wall_s": self.wall_s,
            "positions": self.positions,
            "losses": self.losses,
        }
        tmp = ckpt / f".{_STATE}.tmp"
        tmp.write_text(json.dumps(state) + "\n", encoding="utf-8")
        os.replace(tmp, ckpt / _STATE)
        for old in self._work.glob("ckpt-*"):
            if old != ckpt:
                shutil.rmtree(old, ignore_errors=True)

    # -- internals -------------------------------------------------------------------------

    def _fraction_done(self, budget_s: float) -> float:
        done = self.train_s / budget_s if budget_s > 0 else 1.0
        if self._s.max_steps is not None:
            done = max(done, self.step / self._s.max_steps)
        return done

    def _one_step(self, budget_s: float) -> tuple[float, float]:
        s = self._s
        for group in self._opt.param_groups:
            group["lr"] = lr_at(self._fraction_done(budget_s), s.lr)
        rows = self._rows(self.step)
        c = self._data.corpus
        gen = torch.Generator().manual_seed(self._seed * 1_000_003 + self.step)
        loss, accuracy = head_loss(
            self.head,
            c.labels[rows],
            c.ids[rows],
            self._data.greedy[rows],
            c.valid[rows],
            self._table,
            passes=s.passes,
            noise=s.noise,
            reg_weight=s.reg_weight,
            generator=gen,
            ce_positions=s.ce_positions,
            soft=s.soft,
        )
        self._opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self._params, 1.0)
        self._opt.step()
        self.positions += int((c.valid[rows][:, 1:] & c.valid[rows][:, :-1]).sum())
        return float(loss.detach()), accuracy[0]

    def _rows(self, step: int) -> Tensor:
        """Step ``step``'s rows: epoch after epoch, each a seeded permutation of the corpus."""
        n, b = len(self._data.corpus.ids), self._s.batch
        out = []
        for i in range(step * b, step * b + b):
            epoch, at = divmod(i, n)
            if epoch not in self._perms:
                gen = torch.Generator().manual_seed(self._seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(n, generator=gen)}
            out.append(int(self._perms[epoch][at]))
        return torch.tensor(out)

    def _moments(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, p in enumerate(self._params):
            st = self._opt.state.get(p)
            if st:
                out[f"{i}.exp_avg"] = st["exp_avg"].contiguous()
                out[f"{i}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                out[f"{i}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
        return out

    def _load_moments(self, moments: dict[str, Tensor]) -> None:
        for i, p in enumerate(self._params):
            if f"{i}.exp_avg" in moments:
                self._opt.state[p] = {
                    "step": moments[f"{i}.step"].reshape(()).clone(),
                    "exp_avg": moments[f"{i}.exp_avg"].clone(),
                    "exp_avg_sq": moments[f"{i}.exp_avg_sq"].clone(),
                }

"""``DraftHead``: a feature-conditioned draft (EAGLE family) read out through the target's head.

The target's *feature* at position ``t`` is its final hidden state after its final norm, so
``lm_head(f_t)`` are its logits for token ``t + 1``. The head predicts the next feature::

    u_t = fc(cat(f_t, embed(x_{t+1})))        [D + D] -> [D]
    g_t = norm(Block(u_t))                    one Llama layer (or a few), causal, windowed
    logits for x_{t+2} = g_t @ readout.T      the target's own head rows (a shortlist)

Drafting past the last known feature chains on its own predictions: ``g_{t-1}`` stands in for
``f_t``. The readout is the target's (tied) head restricted to a shortlist of frequent tokens:
on a 135M target the full ``49152 x 576`` head would cost several times the head's layer.

Attention is windowed (``window`` positions, keys ``(t - window, t]``), so a proposer needs
only the last ``window`` features of a prompt, and a step's cost does not grow with the
session.

Training (``unrolled``) runs the head cache-free over whole rows, optionally for several
*passes*: pass ``p`` feeds pass ``p - 1``'s predictions as features and attends exactly as
drafting ``p`` tokens ahead would (real keys up to ``t - p + 1``, then one predicted key per
earlier pass) — the EAGLE-3 "training-time test", so the chain is trained on its own errors.

A checkpoint is a directory: ``head.json`` (config), ``head.safetensors`` (weights, the
frozen embedding and readout rows included, so it loads without the target) with the
shortlist ids as a tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from shard.model.config import ModelConfig
from shard.model.hf_config import to_hf
from shard.model.kvcache import KVCache
from shard.model.llama import Attention, Block, RMSNorm, StageModel, rope_tables

__all__ = ["CONFIG_FILE", "HEAD_VERSION", "WEIGHTS_FILE", "DraftHead", "HeadConfig", "HeadError"]

HEAD_VERSION = 1
"""Bumped whenever what a checkpoint means changes; a checkpoint of another version is refused."""

CONFIG_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"


class HeadError(Exception):
    """A draft head cannot be built or loaded; the message says what to do."""


@attrs.frozen
class HeadConfig:
    """What a head is: the target's architecture, its own depth, window and shortlist size."""

    target: ModelConfig
    layers: int = 1
    window: int = 64
    shortlist: int = 0  # readout rows; 0 = the whole vocabulary

    def __attrs_post_init__(self) -> None:
        if self.layers < 1 or self.window < 1:
            raise HeadError(f"a head needs layers >= 1 and window >= 1, got {self}")
        if not 0 <= self.shortlist <= self.target.vocab_size:
            raise HeadError(f"shortlist {self.shortlist} not in 0..{self.target.vocab_size}")
        if self.target.mla is not None:
            raise HeadError("a draft head of an MLA target (DeepSeek-V3) is not built yet")
        if self.target.linear_attn is not None:
            raise HeadError(
                "a draft head of a linear-attention target (Qwen3-Next) is not built yet"
            )

    @property
    def readout_rows(self) -> int:
        return self.shortlist or self.target.vocab_size

    def to_json(self) -> dict[str, Any]:
        return {
            "head_version": HEAD_VERSION,
            "layers": self.layers,
            "window": self.window,
            "shortlist": self.shortlist,
            "target": to_hf(self.target),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeadConfig:
        if d.get("head_version") != HEAD_VERSION:
            raise HeadError(
                f"head checkpoint version {d.get('head_version')!r}, this shard reads "
                f"{HEAD_VERSION}; rebuild it with `shard draft train --force`"
            )
        try:
            return cls(
                target=ModelConfig.from_hf(d["target"]),
                layers=int(d["layers"]),
                window=int(d["window"]),
                shortlist=int(d["shortlist"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise HeadError(f"not a head config ({type(exc).__name__}: {exc})") from exc


class DraftHead(nn.Module):
    """One (or a few) Llama layers from target features + next-token embeddings to features.

    ``embed`` and ``readout`` are frozen copies of the target's embedding and head rows.
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        t = config.target
        d = t.hidden_size
        self.embed = nn.Embedding(t.vocab_size, d)
        # The target's features (RMS ~1.8 on SmolLM2) and embeddings (~0.14) differ in
        # scale by an order of magnitude: each is normed before they are joined (EAGLE-3).
        self.feature_norm = RMSNorm(d, t.rms_norm_eps)
        self.embed_norm = RMSNorm(d, t.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(Block(t) for _ in range(config.layers))
        self.norm = RMSNorm(d, t.rms_norm_eps)
        self.readout = nn.Parameter(torch.zeros(config.readout_rows, d), requires_grad=False)
        self.shortlist: Tensor
        self.register_buffer("shortlist", torch.arange(config.readout_rows), persistent=False)
        self.embed.weight.requires_grad_(False)
        cos, sin = rope_tables(t)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_target(
        cls,
        target: StageModel,
        *,
        layers: int = 1,
        window: int = 64,
        shortlist: Tensor | None = None,
        seed: int = 0,
    ) -> DraftHead:
        """A fresh head for ``target`` (the whole model): random layers, the target's
        embedding, its head rows for ``shortlist`` (token ids, or all), its final norm."""
        if target.embed_tokens is None or target.lm_head is None or target.norm is None:
            raise HeadError("a head is built from the whole target (embedding to head)")
        rows = 0 if shortlist is None else int(shortlist.numel())
        config = HeadConfig(target=target.config, layers=layers, window=window, shortlist=rows)
        with torch.random.fork_rng(devices=[]):  # seeded init, the caller's RNG untouched
            torch.manual_seed(seed)
            head = cls(config)
        with torch.no_grad():
            head.embed.weight.copy_(target.embed_tokens.weight)
            w = target.lm_head.weight
            head.readout.copy_(w if shortlist is None else w[shortlist])
            if shortlist is not None:
                head.shortlist = shortlist.to(torch.long).clone()
            head.norm.weight.copy_(target.norm.weight)
        return head.float()

    @property
    def feature_dim(self) -> int:
        """The width of one observed feature (the target's hidden size)."""
        return self.config.target.hidden_size

    @property
    def hidden_dim(self) -> int:
        """The width of a predicted feature (the same: the head predicts features)."""
        return self.config.target.hidden_size

    @property
    def feature_window(self) -> int:
        """Trailing prompt features a proposer asks for: the window per layer (each layer
        looks a window further back through the one below)."""
        return self.config.window * self.config.layers

    def trainable(self) -> list[nn.Parameter]:
        """The parameters training moves (everything but the frozen embedding and readout)."""
        return [p for n, p in self.named_parameters() if not n.startswith(("embed", "readout"))]

    def logits(self, g: Tensor) -> Tensor:
        """Readout logits ``[..., N]`` over the shortlist (``to_vocab`` maps an index back)."""
        out: Tensor = g @ self.readout.T
        return out

    def to_vocab(self, index: Tensor) -> Tensor:
        """Shortlist indices -> token ids (the identity without a shortlist)."""
        return self.shortlist[index]

    def inputs(self, features: Tensor, next_ids: Tensor) -> Tensor:
        """``u`` ``[B, S, D]``: features ``[B, S, D]`` joined with the embedded ``next_ids``."""
        joined = (self.feature_norm(features), self.embed_norm(self.embed(next_ids)))
        u: Tensor = self.fc(torch.cat(joined, dim=-1))
        return u

    # -- inference -------------------------------------------------------------------------

    def new_cache(self, max_len: int) -> KVCache:
        """A zeroed KV cache for one session of up to ``max_len`` positions."""
        t = self.config.target
        if max_len > t.max_position_embeddings:
            raise HeadError(f"max_len {max_len} exceeds {t.max_position_embeddings} positions")
        if max_len > self.rope_cos.shape[0]:  # a longer session: longer tables, same first rows
            cos, sin = rope_tables(t, length=max_len)
            self.rope_cos, self.rope_sin = (
                cos.to(self.rope_cos.device),
                sin.to(self.rope_cos.device),
            )
        return KVCache.empty(
            self.config.layers,
            1,
            t.n_kv_heads,
            max_len,
            t.head_dim,
            dtype=self.readout.dtype,
            device=self.readout.device,
        )

    @torch.no_grad()
    def step(
        self, features: Tensor, next_ids: Tensor, start: int, cache: KVCache, *, first: int = 0
    ) -> Tensor:
        """Predicted features ``[1, S, D]`` for positions ``[start, start+S)``.

        Writes K/V there; queries attend to keys in ``[max(first, t - window + 1), t]``
        (``first``: the session's first fed position; older cache rows are never read).
        """
        s = features.shape[1]
        w = self.readout
        h = self.inputs(features.to(w.device, w.dtype), next_ids.to(w.device))  # [1, S, D]
        rope = (self.rope_cos[start : start + s], self.rope_sin[start : start + s])
        lo = max(first, start - self.config.window + 1)
        dev = h.device
        q_pos = torch.arange(start, start + s, device=dev)[:, None]  # [S, 1]
        k_pos = torch.arange(lo, start + s, device=dev)[None, :]  # [1, T]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - self.config.window)  # [S, T]
        for j, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            x = layer.input_layernorm(h)
            q, k, v = layer.self_attn.project(x, rope)  # [1, H|KV, S, Dh]
            keys, values = cache.update(j, start, k, v)  # [1, KV, start+S, Dh]
            y = _attend(layer, q, keys[:, :, lo:], values[:, :, lo:], mask)
            h = _finish(layer, h, y)
        out: Tensor = self.norm(h)
        return out

    # -- training --------------------------------------------------------------------------

    def unrolled(self, features: Tensor, next_ids: Tensor, passes: int = 1) -> list[Tensor]:
        """Predicted features ``[B, S, D]`` per pass, cache-free and autograd-capable.

        Pass 1 reads the real ``features`` ``[B, S, D]`` (``f_t`` with ``x_{t+1}`` =
        ``next_ids[:, t]``); pass ``p`` reads pass ``p - 1``'s output shifted one position
        (``g_{t-1}`` as ``f_t``) and its query at ``t`` sees pass-1 keys up to ``t - p + 1``
        and pass ``q``'s key at ``t - p + q``: what drafting ``p`` tokens ahead sees. Rows
        ``t < p - 1`` of pass ``p`` have no such history and are garbage (mask their loss).
        """
        s = features.shape[1]
        rope = (self.rope_cos[:s], self.rope_sin[:s])
        window = self.config.window
        pos = torch.arange(s, device=features.device)
        outs: list[Tensor] = []
        kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]  # per layer, per pass
        feats = features
        for p in range(1, passes + 1):
            h = self.inputs(feats, next_ids)  # [B, S, D]
            masks = _pass_masks(pos, p, window)  # p masks [S, S], one per earlier pass
            for j, layer in enumerate(self.layers):
                assert isinstance(layer, Block)
                q, k, v = layer.self_attn.project(layer.input_layernorm(h), rope)
                kv[j].append((k, v))
                keys = torch.cat([kk for kk, _ in kv[j]], dim=2)  # [B, KV, p*S, Dh]
                values = torch.cat([vv for _, vv in kv[j]], dim=2)
                y = _attend(layer, q, keys, values, torch.cat(masks, dim=1))
                h = _finish(layer, h, y)
            g = self.norm(h)
            outs.append(g)
            feats = torch.cat((torch.zeros_like(g[:, :1]), g[:, :-1]), dim=1)  # g_{t-1} as f_t
        return outs

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, out_dir: Path) -> None:
        """Write ``head.json`` and ``head.safetensors`` into the existing ``out_dir``."""
        out_dir = Path(out_dir)
        tensors = {n: p.detach().contiguous() for n, p in self.state_dict().items()}
        tensors["shortlist"] = self.shortlist.contiguous()
        weights = out_dir / WEIGHTS_FILE
        save_file(tensors, str(weights), metadata={"format": "pt"})
        os.chmod(weights, 0o644)
        (out_dir / CONFIG_FILE).write_text(
            json.dumps(self.config.to_json(), indent=2) + "\n", encoding="utf-8"
        )

    @classmethod
    def load(cls, path: Path, *, device: torch.device | str = "cpu") -> DraftHead:
        """A head saved by ``save``. Errors: ``HeadError`` for anything missing or mismatched."""
        path = Path(path)
        try:
            config = HeadConfig.from_json(
                json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
            )
            tensors = load_file(str(path / WEIGHTS_FILE), device=str(device))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as exc:
            raise HeadError(f"cannot read a draft head from {path}: {exc}") from exc
        head = cls(config).to(device)
        shortlist = tensors.pop("shortlist", None)
        want = {n: tuple(t.shape) for n, t in head.state_dict().items()}
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if want != got or shortlist is None or shortlist.shape != (config.readout_rows,):
            raise HeadError(f"{path / WEIGHTS_FILE} does not match {path / CONFIG_FILE}")
        ids = shortlist.to(torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= config.target.vocab_size:
            raise HeadError(f"{path / WEIGHTS_FILE}: shortlist ids outside the vocabulary")
        head.load_state_dict(tensors)
        head.shortlist = ids
        return head.eval()


def _pass_masks(pos: Tensor, p: int, window: int) -> list[Tensor]:
    """Pass ``p``'s boolean masks ``[S, S]`` over pass ``1..p``'s keys (see ``unrolled``)."""
    q_pos, k_pos = pos[:, None], pos[None, :]
    real = (k_pos <= q_pos - p + 1) & (k_pos > q_pos - window)
    return [real] + [k_pos == q_pos - p + q for q in range(2, p + 1)]


def _attend(layer: Block, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention ``[B, H, S, Dh]`` (every mask row holds its own position, so none is empty)."""
    attn = layer.self_attn
    assert isinstance(attn, Attention)  # a head's own layer is a Llama layer (never MLA)
    y: Tensor = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask,
        scale=attn.head_dim**-0.5,
        enable_gqa=attn.n_heads != attn.n_kv_heads,
    )
    return y


def _finish(layer: Block, h: Tensor, y: Tensor) -> Tensor:
    """The rest of ``Block.forward`` after attention ``y`` ``[B, H, S, Dh]``: residuals, MLP."""
    b, _, s, _ = y.shape
    h = h + layer.self_attn.o_proj(y.transpose(1, 2).reshape(b, s, -1))  # [B, S, D]
    out: Tensor = h + layer.mlp(layer.post_attention_layernorm(h))
    return out

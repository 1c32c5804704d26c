"""The EAGLE-3 head's published files, read checked: ``config.json`` as SpecForge writes it
(``Eagle3Config``) and the tensors of ``model.safetensors`` (``expected``: every name and
shape; ``read_checked``: the header checked before any tensor is read, then ``d2t``/``t2d``).

Model files come from strangers: anything wrong is an ``Eagle3Error`` saying what, never a
crash later. ``shard.decode.head.eagle3`` is the head these files hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from shard.decode.head.shipped import ARCHITECTURES, CONFIG_FILE
from shard.model.config import ModelConfig
from shard.model.config_fields import ModelLoadError

__all__ = [
    "ARCHITECTURES",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "Eagle3Config",
    "Eagle3Error",
    "Eagle3NeedsEmbedding",
    "default_layers",
    "expected",
    "read_checked",
]

WEIGHTS_FILE = "model.safetensors"
_FLOATS = ("F16", "BF16", "F32")


class Eagle3Error(Exception):
    """An EAGLE-3 head cannot be loaded or does not fit its target; the message says why."""


class Eagle3NeedsEmbedding(Eagle3Error):
    """The head's file holds no ``embed_tokens`` and no target embedding was given: load it
    again with the target's (``Eagle3Head.load(embedding=...)``)."""


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """The published default: the stream entering layers ``2``, ``L // 2`` and ``L - 3``."""
    return (2, n_layers // 2, n_layers - 3)


@attrs.frozen
class Eagle3Config:
    """A head's geometry: its own one-layer Llama shape, the draft vocabulary, the width of
    the target states it reads and the layers it declares (None: the default)."""

    model: ModelConfig
    draft_vocab: int
    target_hidden: int
    n_aux: int = 3
    layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False  # vLLM's option: the residual is hidden_norm(u)

    @property
    def feature_dim(self) -> int:
        return self.n_aux * self.target_hidden

    @classmethod
    def from_json(cls, d: Any, where: str = CONFIG_FILE) -> Eagle3Config:
        """Checked ``config.json`` of a head. ``Eagle3Error`` for anything unusable."""
        if not isinstance(d, dict):
            raise Eagle3Error(f"{where} is not a JSON object")
        archs = d.get("architectures")
        if not isinstance(archs, list) or not set(archs) & set(ARCHITECTURES):
            raise Eagle3Error(
                f"{where}: architectures {archs!r} is not an EAGLE-3 head "
                f"({', '.join(ARCHITECTURES)})"
            )
        if d.get("num_hidden_layers") != 1:
            raise Eagle3Error(
                f"{where}: a head of {d.get('num_hidden_layers')!r} layers; 1 is read"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise Eagle3Error(f"{where}: hidden_act {d.get('hidden_act')!r}, only silu is read")
        llama = {**d, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        try:
            model = ModelConfig.from_hf(llama, where)
        except ModelLoadError as exc:
            raise Eagle3Error(str(exc)) from None
        vocab, hidden = model.vocab_size, model.hidden_size
        draft_vocab = _int(d.get("draft_vocab_size", vocab), "draft_vocab_size", where, vocab)
        target_hidden = _int(d.get("target_hidden_size", hidden), "target_hidden_size", where)
        eagle = d.get("eagle_config")
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        if ids is None and isinstance(eagle, dict):
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        layer_ids = None if ids is None else _layer_ids(ids, where)
        n_aux = 3 if layer_ids is None else len(layer_ids)
        if hidden == n_aux * target_hidden:  # chained and fused inputs would look alike
            raise Eagle3Error(f"{where}: hidden_size {hidden} = {n_aux} x target_hidden_size")
        before = d.get("norm_before_residual", False)
        if not isinstance(before, bool):
            raise Eagle3Error(f"{where}: norm_before_residual = {before!r}, not true or false")
        return cls(model, draft_vocab, target_hidden, n_aux, layer_ids, before)

    def layers_for(self, n_layers: int) -> tuple[int, ...]:
        """The target layers whose entering states feed the head, for a target of
        ``n_layers``: those declared, else the default. ``Eagle3Error`` if they do not fit."""
        ids = self.layer_ids if self.layer_ids is not None else default_layers(n_layers)
        if len(set(ids)) != len(ids) or not all(0 <= i < n_layers for i in ids):
            raise Eagle3Error(f"layers {ids} do not fit a target of {n_layers} layers")
        return tuple(ids)

    def check_target(self, target: ModelConfig) -> None:
        """``Eagle3Error`` unless the head reads this target: same vocabulary and width."""
        if target.vocab_size != self.model.vocab_size:
            raise Eagle3Error(
                f"the head's vocab_size {self.model.vocab_size} is not the target's "
                f"{target.vocab_size}: it was trained for another model"
            )
        if target.hidden_size != self.target_hidden:
            raise Eagle3Error(
                f"the head reads states of width {self.target_hidden}, the target's are "
                f"{target.hidden_size}: it was trained for another model"
            )
        self.layers_for(target.n_layers)


def _int(v: Any, key: str, where: str, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (hi is not None and v > hi):
        bounds = "a positive integer" if hi is None else f"an integer in [1, {hi}]"
        raise Eagle3Error(f"{where}: {key} = {v!r}, not {bounds}")
    return v


def _layer_ids(v: Any, where: str) -> tuple[int, ...]:
    ok = isinstance(v, list) and 1 <= len(v) <= 8
    ok = ok and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
    if not ok or list(v) != sorted(set(v)):
        raise Eagle3Error(
            f"{where}: eagle_aux_hidden_state_layer_ids {v!r} is not a strictly increasing "
            "list of layer indices"
        )
    return tuple(v)


def expected(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the published layout and its shape (``embed_tokens``, ``d2t``
    and ``t2d`` included; ``_read_checked`` says which may be absent)."""
    c = config.model
    d, d2, i = c.hidden_size, 2 * c.hidden_size, c.intermediate_size
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layer = {
        "input_layernorm.weight": (d,),
        "hidden_norm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d2),
        "self_attn.k_proj.weight": (kv, d2),
        "self_attn.v_proj.weight": (kv, d2),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (i, d),
        "mlp.up_proj.weight": (i, d),
        "mlp.down_proj.weight": (d, i),
    }
    return {
        "embed_tokens.weight": (c.vocab_size, d),
        "fc.weight": (d, config.feature_dim),
        **{f"midlayer.{n}": s for n, s in layer.items()},
        "norm.weight": (d,),
        "lm_head.weight": (config.draft_vocab, d),
        "d2t": (config.draft_vocab,),
        "t2d": (c.vocab_size,),
    }


def read_checked(file: Path, config: Eagle3Config, embedding: Tensor | None) -> dict[str, Tensor]:
    """The file's tensors, after every name, shape and dtype was checked from its header,
    then ``d2t`` and ``t2d`` by value. Adds ``embedding`` and defaults for what may be absent."""
    want = expected(config)
    try:
        with safe_open(str(file), framework="pt") as f:
            slices = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (not a dict)
            header = {n: (tuple(x.get_shape()), x.get_dtype()) for n, x in slices.items()}
            unknown = sorted(set(header) - set(want))
            if unknown:
                raise Eagle3Error(
                    f"{file}: tensors not in an EAGLE-3 head: {', '.join(unknown[:5])}"
                )
            _check_header(file, config, header, want, embedding)
            tensors = {n: f.get_tensor(n) for n in header}
    except (OSError, SafetensorError) as exc:
        raise Eagle3Error(f"cannot read the EAGLE-3 head's weights {file}: {exc}") from None
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        raise Eagle3Error(f"{file}: {', '.join(bad[:3])} hold NaN or infinity (a damaged file)")
    if embedding is not None and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = embedding.detach().cpu()
    v, n = config.model.vocab_size, config.draft_vocab
    d2t = tensors.get("d2t")
    tensors["d2t"] = torch.zeros(n, dtype=torch.long) if d2t is None else d2t.to(torch.long)
    t2d = tensors.get("t2d")
    _check_vocab_map(file, tensors["d2t"], t2d, v)
    if t2d is None:
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[torch.arange(n) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    return tensors


def _check_header(
    file: Path,
    config: Eagle3Config,
    header: Mapping[str, tuple[tuple[int, ...], str]],
    want: Mapping[str, tuple[int, ...]],
    embedding: Tensor | None,
) -> None:
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = sorted(set(want) - set(header) - optional)
    if missing:
        raise Eagle3Error(f"{file}: missing {', '.join(missing)}")
    if "embed_tokens.weight" not in header:
        shape = want["embed_tokens.weight"]
        if embedding is None:
            raise Eagle3NeedsEmbedding(
                f"{file} has no embed_tokens: the target's embedding {shape} is needed"
            )
        if tuple(embedding.shape) != shape:
            got = str(tuple(embedding.shape))
            raise Eagle3Error(
                f"{file} has no embed_tokens: the target's embedding {shape} is needed "
                f"({got} given)"
            )
    if "d2t" not in header and config.draft_vocab != config.model.vocab_size:
        raise Eagle3Error(f"{file}: a draft vocabulary of {config.draft_vocab} needs d2t")
    for name, (shape, dtype) in header.items():
        if shape != want[name]:
            raise Eagle3Error(f"{file}: {name} has shape {shape}, {want[name]} expected")
        ok = {"d2t": ("I64", "I32"), "t2d": ("BOOL",)}.get(name, _FLOATS)
        if dtype not in ok:
            raise Eagle3Error(f"{file}: {name} is {dtype}, not {' or '.join(ok)}")


def _check_vocab_map(file: Path, d2t: Tensor, t2d: Tensor | None, vocab: int) -> None:
    """Draft ids map into the vocabulary, one to one, and agree with ``t2d`` when it is there."""
    target = torch.arange(len(d2t)) + d2t
    if len(target) and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise Eagle3Error(f"{file}: d2t maps draft ids outside the vocabulary of {vocab}")
    if len(torch.unique(target)) != len(target):
        raise Eagle3Error(f"{file}: d2t maps two draft ids to one token")
    if t2d is not None and (int(t2d.sum()) != len(target) or not bool(t2d[target].all())):
        raise Eagle3Error(f"{file}: t2d does not mark exactly the tokens d2t maps to")

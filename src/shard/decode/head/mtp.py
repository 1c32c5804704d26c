"""``MtpHead``: a checkpoint's own multi-token-prediction block (DeepSeek-V3, GLM-4.5) as a
draft head, read from the target's files — nothing to train.

Such a checkpoint declares ``num_nextn_predict_layers`` blocks after its ``L`` decoder layers
and stores the first as ``model.layers.{L}.*``: a full decoder layer of the family under the
usual names (attention, MoE, both norms) plus ``enorm``, ``hnorm``, ``eh_proj`` (``[D, 2D]``),
``shared_head.norm``, ``shared_head.head`` (``[V, D]``) and ``embed_tokens`` (``[V, D]``; the
last two copies of the target's, used from the target when absent). transformers does not load
these tensors; this module follows vLLM's ``DeepSeekMultiTokenPredictorLayer``, which serves
them. At head position ``t`` (it reads the token ``x_{t+1}``)::

    e_t = embed(x_{t+1})            zeroed at position 0, as vLLM does
    u_t = eh_proj(cat(enorm(e_t), hnorm(h_t)))          embedding first    [D]
    g_t = layer(u_t)                the decoder layer at position t, its own KV cache
    draft for x_{t+2} = argmax(shared_head.head(shared_head.norm(g_t)))

``h_t`` is the target's final-norm output at position ``t`` — the features the tail already
returns for a draft head (``Verdict.features``) — and chained drafts feed ``g_t`` in its place,
as vLLM chains one block ``K`` times. Only the first MTP block is read; a checkpoint with more
(``num_nextn_predict_layers > 1``) drafts with its first, chained.

It runs where ``HeadProposer`` runs, at the coordinator (docs/drafts.md, "MTP": what that
costs, and why the tail would be the place for a large target's block).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from torch import Tensor, nn

from shard.model.attention import RMSNorm
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.fp8 import dequantize_fp8
from shard.model.jsonfile import read_json
from shard.model.kvcache import KVCache
from shard.model.llama import StageModel
from shard.model.loader import checkpoint_index, load_stage
from shard.model.masks import causal_mask
from shard.model.tensorfile import open_tensors

__all__ = ["MTP_WINDOW", "MtpError", "MtpHead", "has_mtp_block", "mtp_layers"]

#: Prompt rows of final-norm features the block reads back, as a draft head asks.
MTP_WINDOW = 64
_MAX_CONFIG_BYTES = 1 << 20
_MAX_BLOCKS = 16
_EMBED = "model.embed_tokens.weight"
_HEADS = ("lm_head.weight", _EMBED)  # the target's head, or its tied embedding


class MtpError(ValueError):
    """A checkpoint without MTP blocks, or whose MTP tensors are missing or malformed."""


def mtp_layers(model_dir: Path) -> int:
    """How many MTP blocks ``model_dir``'s ``config.json`` declares
    (``num_nextn_predict_layers``; 0 when absent). Errors: ``MtpError`` for a value that is
    not an integer in ``0..16``, ``ModelLoadError`` for an unreadable config."""
    raw = read_json(
        Path(model_dir) / "config.json",
        max_bytes=_MAX_CONFIG_BYTES,
        error=ModelLoadError,
        what="config.json",
    )
    n = raw.get("num_nextn_predict_layers", 0) if isinstance(raw, dict) else 0
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_BLOCKS:
        raise MtpError(f"{model_dir}: num_nextn_predict_layers {n!r} is not in 0..{_MAX_BLOCKS}")
    return n


def has_mtp_block(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds an MTP block, not only declares one: its config's
    ``num_nextn_predict_layers`` is at least 1 and ``model.layers.{L}.eh_proj.weight`` is in
    its files (transformers saves checkpoints that declare a block they do not hold). A
    config or index that cannot be read holds none."""
    try:
        if mtp_layers(model_dir) < 1:
            return False
        n = ModelConfig.from_dir(model_dir).n_layers
        return f"model.layers.{n}.eh_proj.weight" in checkpoint_index(model_dir)
    except (MtpError, ModelLoadError, OSError, ValueError):
        return False


class MtpHead(nn.Module):
    """The first MTP block of a checkpoint, with the readout and embedding it drafts with."""

    def __init__(self, block: StageModel, vocab: int) -> None:
        super().__init__()
        d, eps = block.config.hidden_size, block.config.rms_norm_eps
        self.block = block  # layers [L, L + 1) of a config with L + 2 layers: no head, no embed
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.head_norm = RMSNorm(d, eps)
        self.head = nn.Linear(d, vocab, bias=False)
        self.embed_tokens = nn.Embedding(vocab, d)

    # -- what a proposer reads (``HeadProposer``) --------------------------------------------

    @property
    def feature_dim(self) -> int:
        """The width of one position's target features (the final norm's output)."""
        return self.block.config.hidden_size

    @property
    def hidden_dim(self) -> int:
        return self.block.config.hidden_size

    @property
    def feature_window(self) -> int:
        """Prompt positions of features it wants (its attention sees no further back)."""
        return MTP_WINDOW

    def logits(self, g: Tensor) -> Tensor:
        """Logits ``[..., V]`` from the block's outputs ``g``."""
        out: Tensor = self.head(self.head_norm(g))
        return out

    def to_vocab(self, index: Tensor) -> Tensor:
        """The readout is over the target's vocabulary: ids are the target's."""
        return index

    def new_cache(self, max_len: int) -> KVCache:
        """A zeroed KV cache of the block for one session of up to ``max_len`` positions."""
        try:
            return self.block.new_cache(max_len)
        except ValueError as e:
            raise MtpError(str(e)) from None

    @torch.no_grad()
    def step(
        self, states: Tensor, next_ids: Tensor, start: int, cache: KVCache, *, first: int = 0
    ) -> Tensor:
        """``g`` ``[1, S, D]`` for positions ``[start, start+S)`` from the target's features (or
        chained outputs) ``[1, S, D]`` and the next tokens ``[1, S]``; writes K/V there and
        attends to ``[first, t]`` (positions before ``first`` were never fed)."""
        w = self.eh_proj.weight
        s = int(states.shape[1])
        pos = torch.arange(start, start + s, device=w.device)
        e = self.embed_tokens(next_ids.to(w.device)).masked_fill((pos == 0)[None, :, None], 0.0)
        u = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(states.to(w.device, w.dtype))), -1))
        layer = self.block.blocks()[0]
        rope = self.block.ropes_at(slice(start, start + s), u.dtype)[layer.local_rope]
        mask = causal_mask(start, s, w.device, layer.window)
        mask[:, :first] = False
        out: Tensor = layer(u, rope, mask, cache, self.block.cache_slot(0), start)
        return out

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> MtpHead:
        """The first MTP block of the checkpoint in ``model_dir``, in ``dtype`` (a quantized
        checkpoint's decoder layer stays stored, as a stage's would; the small tensors beside
        it are dense).

        Errors: ``MtpError`` for a checkpoint that declares no MTP block, or whose block's
        tensors are missing or of the wrong shape; ``ModelLoadError`` for what the loader
        refuses in the decoder layer itself (an unsupported family, say)."""
        model_dir = Path(model_dir)
        target = ModelConfig.from_dir(model_dir)
        if mtp_layers(model_dir) < 1:
            raise MtpError(
                f"{model_dir}: the checkpoint declares no MTP block (num_nextn_predict_layers "
                'is 0 or absent); use another draft, e.g. draft = "ngram"'
            )
        if target.v4 is not None or target.is_linear(target.n_layers - 1):
            raise MtpError(f"{model_dir}: MTP blocks of this family are not read (docs/drafts.md)")
        n = target.n_layers
        index = checkpoint_index(model_dir)
        prefix = f"model.layers.{n}."
        if f"{prefix}eh_proj.weight" not in index:
            raise MtpError(
                f"{model_dir}: config.json declares an MTP block but {prefix}eh_proj.weight is "
                "not in the checkpoint (was it converted or downloaded without it?)"
            )
        try:
            config = _block_config(target)
            block = load_stage(model_dir, n, n + 1, dtype=dtype, device=device, config=config)
        except (ModelLoadError, ValueError) as e:
            raise MtpError(f"the MTP block of {model_dir}: {e}") from None
        head = cls(block, target.vocab_size)
        d, v = target.hidden_size, target.vocab_size
        names = {
            "enorm.weight": (f"{prefix}enorm.weight", (d,)),
            "hnorm.weight": (f"{prefix}hnorm.weight", (d,)),
            "eh_proj.weight": (f"{prefix}eh_proj.weight", (d, 2 * d)),
            "head_norm.weight": (f"{prefix}shared_head.norm.weight", (d,)),
            "head.weight": (_first(index, f"{prefix}shared_head.head.weight", *_HEADS), (v, d)),
            "embed_tokens.weight": (_first(index, f"{prefix}embed_tokens.weight", _EMBED), (v, d)),
        }
        state = {
            local: _read(model_dir, index, remote, shape, target.weight_block)
            for local, (remote, shape) in names.items()
        }
        with torch.no_grad():
            for local, tensor in state.items():
                head.get_parameter(local).copy_(tensor)
        for module in (head.enorm, head.hnorm, head.eh_proj, head.head_norm, head.head):
            module.to(dtype)
        head.embed_tokens.to(dtype)
        return head.to(device).eval()


def _block_config(target: ModelConfig) -> ModelConfig:
    """The config that builds the block as layer ``L`` of ``L + 2`` (so it is neither the
    first stage nor the tail): a mixture of experts where the target's last layer is one, as
    DeepSeek-V3's and GLM-4.5's blocks are."""
    n = target.n_layers
    config = attrs.evolve(target, n_layers=n + 2)
    if target.moe is not None and target.is_sparse(n - 1):
        moe = attrs.evolve(target.moe, sparse_layers=(*target.moe.sparse_layers, n))
        config = attrs.evolve(config, moe=moe)
    return config


def _first(index: dict[str, str], *names: str) -> str:
    """The first of ``names`` the checkpoint holds (the last named when none is: its read
    then says it is missing)."""
    return next((name for name in names if name in index), names[-1])


def _read(
    model_dir: Path,
    index: dict[str, str],
    name: str,
    shape: tuple[int, ...],
    block: tuple[int, int] | None,
) -> Tensor:
    """Tensor ``name`` as float32, shape-checked; an FP8 one (``weight_scale_inv`` beside it)
    dequantized with the checkpoint's block."""
    t = _tensor(model_dir, index, name)
    if tuple(t.shape) != shape:
        raise MtpError(f"{model_dir}: {name} is {list(t.shape)}, expected {list(shape)}")
    if t.dtype == torch.float8_e4m3fn:
        scale = f"{name}_scale_inv"
        if block is None or scale not in index:
            raise MtpError(f"{model_dir}: {name} is FP8 without its {scale} and block")
        try:
            return dequantize_fp8(t, _tensor(model_dir, index, scale), block)
        except ValueError as e:
            raise MtpError(f"{model_dir}: {name}: {e}") from None
    if not t.is_floating_point():
        raise MtpError(f"{model_dir}: {name} is {t.dtype}, not a float tensor")
    return t.float()


def _tensor(model_dir: Path, index: dict[str, str], name: str) -> Tensor:
    if name not in index:
        raise MtpError(f"{model_dir}: the MTP block's tensor {name!r} is missing")
    try:
        with open_tensors(model_dir / index[name]) as f:
            return f.get_tensor(name)
    except (OSError, KeyError, ValueError) as e:
        raise MtpError(f"{model_dir}: cannot read {name}: {e}") from None

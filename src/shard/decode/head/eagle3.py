"""``Eagle3Head``: an EAGLE-3 draft head in its published layout, run at the coordinator.

The layout is the one SpecForge writes and vLLM and SGLang load: a directory holding
``config.json`` (a Llama config with ``architectures = ["LlamaForCausalLMEagle3"]``,
``num_hidden_layers = 1``, ``draft_vocab_size``, optionally ``target_hidden_size`` and
``eagle_aux_hidden_state_layer_ids``, at the top level or under ``eagle_config``) and
``model.safetensors`` holding ``fc``, one decoder layer named ``midlayer.*`` (with an extra
``hidden_norm``), ``norm``, ``lm_head`` over the draft vocabulary, ``d2t`` (int64 offsets: draft
id ``d`` is target id ``d + d2t[d]``), optionally ``t2d`` (bool over the target vocabulary) and
``embed_tokens`` (often left out: it is the target's, given to ``load``).

What it computes at head position ``t`` (it reads the token ``x_{t+1}``)::

    a_t = cat(h[l1]_t, h[l2]_t, h[l3]_t)                      [3 Dt]  the target's residual
                                                                     stream entering l1, l2, l3
    u_t = fc(a_t)                                             [D]
    x_t = cat(input_layernorm(embed(x_{t+1})), hidden_norm(u_t))   [2 D]  embedding first
    r_t = u_t + o_proj(attention(x_t))                        causal, rotary at position t
                                                  (hidden_norm(u_t) + ... with norm_before_residual)
    g_t = r_t + mlp(post_attention_layernorm(r_t))            [D]     chained as is
    draft for x_{t+2} = d + d2t[d], d = argmax(lm_head(norm(g_t)))

Past the last position with the target's states it chains: ``g_{t-1}`` (already ``D`` wide,
so ``fc`` is skipped) stands in for ``u_t``. Which layers feed it is ``shard.decode.head.
eagle3_check``'s subject; the convention here is vLLM's and SGLang's: ``h[l]`` *enters*
layer ``l`` (0-based), by default ``(2, L // 2, L - 3)`` for a target of ``L`` layers.

Its files are read checked by ``shard.decode.head.eagle3_files``: a malformed head is an
``Eagle3Error`` saying what, never a crash later.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.decode.head.eagle3_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3Error,
    read_checked,
)
from shard.model.attention import RMSNorm, apply_rotary, rope_tables
from shard.model.config import ModelConfig
from shard.model.jsonfile import read_json
from shard.model.kvcache import KVCache
from shard.model.loader import load_stage

__all__ = ["Eagle3Head", "target_embedding"]

_MAX_CONFIG_BYTES = 1 << 20
_WINDOW = 64  # prompt rows of target states asked for (docs/drafts.md: what they cost)


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        d2 = 2 * c.hidden_size
        self.q_proj = nn.Linear(d2, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(d2, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(d2, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _MidLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)  # the token's embedding
        self.hidden_norm = RMSNorm(d, eps)  # the fused (or chained) state
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """The head's modules under the published names (``state_dict`` keys are the file's)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        c = config.model
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(config.feature_dim, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab, bias=False)
        self.d2t: Tensor
        self.t2d: Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        cos, sin = rope_tables(c)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # -- what a proposer reads (``HeadProposer``) --------------------------------------------

    @property
    def feature_dim(self) -> int:
        """The width of one position's target states (``n_aux x target hidden``)."""
        return self.config.feature_dim

    @property
    def hidden_dim(self) -> int:
        return self.config.model.hidden_size

    @property
    def feature_window(self) -> int:
        """Prompt positions of target states it wants. Its attention is not windowed, so more
        would show it more of a long prompt; each row is ``feature_dim`` wide on the wire,
        three times a ``DraftHead``'s, so it asks for the head's usual 64."""
        return _WINDOW

    def logits(self, g: Tensor) -> Tensor:
        """Logits ``[..., N]`` over the draft vocabulary from chained states ``g``."""
        out: Tensor = self.lm_head(self.norm(g))
        return out

    def to_vocab(self, index: Tensor) -> Tensor:
        """Draft ids -> target ids (``d + d2t[d]``)."""
        return index + self.d2t[index]

    # -- the forward -------------------------------------------------------------------------

    def project(self, states: Tensor) -> Tensor:
        """``u`` ``[..., D]``: fused target states (``feature_dim`` wide) through ``fc``, or
        chained states (``D`` wide) as they are."""
        if states.shape[-1] == self.feature_dim:
            u: Tensor = self.fc(states)
            return u
        if states.shape[-1] == self.hidden_dim:
            return states
        raise Eagle3Error(f"states of width {states.shape[-1]}: {self.feature_dim} or D expected")

    def forward(self, states: Tensor, next_ids: Tensor) -> Tensor:
        """Chained states ``g`` ``[B, S, D]`` at positions ``0..S-1``, cache-free, causal over
        the whole call and autograd-capable (training, and the layer check)."""
        s = int(states.shape[1])
        self._cover(s)
        u = self.project(states)
        q, k, v = self._qkv(u, next_ids, 0)
        mask = torch.ones(s, s, dtype=torch.bool, device=u.device).tril()
        return self._rest(u, self._attend(q, k, v, mask))

    def new_cache(self, max_len: int) -> KVCache:
        """A zeroed KV cache for one session of up to ``max_len`` positions."""
        c = self.config.model
        if max_len > c.max_position_embeddings:
            raise Eagle3Error(f"max_len {max_len} exceeds {c.max_position_embeddings} positions")
        self._cover(max_len)
        w = self.lm_head.weight
        return KVCache.empty(
            1, 1, c.n_kv_heads, max_len, c.head_dim, dtype=w.dtype, device=w.device
        )

    def _cover(self, n: int) -> None:
        """Rope tables for positions ``[0, n)`` at least (longer tables, same first rows)."""
        if n > self.rope_cos.shape[0]:
            cos, sin = rope_tables(self.config.model, length=n)
            dev = self.rope_cos.device
            self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

    @torch.no_grad()
    def step(
        self, states: Tensor, next_ids: Tensor, start: int, cache: KVCache, *, first: int = 0
    ) -> Tensor:
        """Chained states ``[1, S, D]`` for positions ``[start, start+S)`` from target states
        or chained ones ``[1, S, *]``; writes K/V there and attends to ``[first, t]``."""
        w = self.lm_head.weight
        s = int(states.shape[1])
        u = self.project(states.to(w.device, w.dtype))
        q, k, v = self._qkv(u, next_ids.to(w.device), start)
        keys, values = cache.update(0, start, k, v)  # [1, KV, start+S, Dh]
        q_pos = torch.arange(start, start + s, device=w.device)[:, None]  # [S, 1]
        k_pos = torch.arange(first, start + s, device=w.device)[None, :]  # [1, T]
        y = self._attend(q, keys[:, :, first:], values[:, :, first:], k_pos <= q_pos)
        out: Tensor = self._rest(u, y)
        return out

    def _qkv(self, u: Tensor, next_ids: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, S, Dh]``, keys and values ``[B, KV, S, Dh]``, rotated."""
        m, (b, s, _) = self.midlayer, u.shape
        x = torch.cat((m.input_layernorm(self.embed_tokens(next_ids)), m.hidden_norm(u)), dim=-1)
        a = m.self_attn
        q = a.q_proj(x).view(b, s, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, s, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, s, a.n_kv, a.head_dim).transpose(1, 2)
        cos = self.rope_cos[start : start + s].to(u.dtype)
        sin = self.rope_sin[start : start + s].to(u.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        a = self.midlayer.self_attn
        y: Tensor = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=a.n_heads != a.n_kv
        )
        return y  # [B, H, S, Dh]

    def _rest(self, u: Tensor, y: Tensor) -> Tensor:
        """Residuals and the MLP after attention ``y`` ``[B, H, S, Dh]``: ``g`` ``[B, S, D]``."""
        m, (b, _, s, _) = self.midlayer, y.shape
        residual = m.hidden_norm(u) if self.config.norm_before_residual else u
        r = residual + m.self_attn.o_proj(y.transpose(1, 2).reshape(b, s, -1))
        out: Tensor = r + m.mlp(m.post_attention_layernorm(r))
        return out

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        embedding: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Eagle3Head:
        """The head in ``path`` (``config.json``, ``model.safetensors``), in ``dtype``.

        ``embedding``: the target's token embedding ``[V, D]``, used when the file has none.
        Errors: ``Eagle3Error`` for a missing, malformed or inconsistent file.
        """
        path = Path(path)
        config = Eagle3Config.from_json(
            read_json(
                path / CONFIG_FILE,
                max_bytes=_MAX_CONFIG_BYTES,
                error=Eagle3Error,
                what=f"the EAGLE-3 head's {CONFIG_FILE}",
            ),
            str(path / CONFIG_FILE),
        )
        if not (path / WEIGHTS_FILE).exists() and (path / "pytorch_model.bin").exists():
            raise Eagle3Error(
                f"{path} holds pytorch_model.bin, a pickle this never loads: convert it to "
                f"{WEIGHTS_FILE} (safetensors) where you trust the file"
            )
        tensors = read_checked(path / WEIGHTS_FILE, config, embedding)
        head = cls(config)
        head.load_state_dict(tensors)
        for module in (head.embed_tokens, head.fc, head.midlayer, head.norm, head.lm_head):
            module.to(dtype)  # the rope tables stay fp32, as the target's do
        return head.to(device).eval()


def target_embedding(model_dir: Path) -> Tensor:
    """The target's token embedding ``[V, D]`` in fp32, unscaled, as a head without
    ``embed_tokens`` takes it: read from the model's files through its first stage of one
    layer, which is dropped once the table is out."""
    stage = load_stage(model_dir, 0, 1, dtype=torch.float32)
    assert stage.embed_tokens is not None
    with torch.inference_mode():
        table: Tensor = stage.embed_tokens(torch.arange(stage.config.vocab_size)).clone()
    return table

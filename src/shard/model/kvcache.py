"""A static, preallocated KV cache for one stage's layers and one session.

Rollback is overwrite-by-position: a forward at ``[start, start+S)`` writes K/V there and reads
only ``[0, start+S)``, so entries past the committed frontier (a rejected draft chunk) are never
read before they are overwritten. Nothing here ever needs to be "truncated".
"""

from __future__ import annotations

import torch
from torch import Tensor

from shard.model.recurrent import RecurrentCache

__all__ = ["KVCache"]


class KVCache:
    """Keys and values ``[n_layers_in_block, B, n_kv_heads, max_len, head_dim]``.

    Preallocated once per session so the forward pass never allocates cache memory and every
    chunk shape sees the same storage (what CUDA graphs need). ``v`` may be narrower than
    ``k`` (``v_dim``): an MLA layer (``shard.model.mla``) keeps its latent in ``k`` and its
    rotary key in ``v``, one head each (GLM-5: the DSA indexer's key after it in ``v``,
    ``shard.model.dsa``). Everything here acts on the position axis alone.

    In a model with linear-attention layers (Qwen3-Next), ``k`` and ``v`` hold the attention
    layers of the stage only (possibly none) and ``recurrent`` the linear layers' states
    (``shard.model.recurrent``): ``StageModel.cache_slot`` maps a layer to its index in either.
    """

    def __init__(self, k: Tensor, v: Tensor, recurrent: RecurrentCache | None = None) -> None:
        if k.dim() != 5 or v.dim() != 5 or k.shape[:4] != v.shape[:4] or k.dtype != v.dtype:
            raise ValueError(
                "KVCache wants k and v of one dtype and of shapes "
                f"[layers, B, kv_heads, max_len, head_dim | v_dim]; got {tuple(k.shape)} "
                f"{k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        self.k = k
        self.v = v
        self.recurrent = recurrent

    @classmethod
    def empty(
        cls,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        v_dim: int | None = None,
    ) -> KVCache:
        """A zero-filled cache (zeros, not ``empty``, so stray reads are at least deterministic);
        ``v_dim``: the values' width when it is not ``head_dim``."""
        if n_layers < 0 or batch < 1 or max_len < 1:
            raise ValueError(
                f"KVCache needs n_layers >= 0, batch and max_len >= 1; got {n_layers}, {batch}, "
                f"{max_len}"
            )
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        if v_dim is None or v_dim == head_dim:
            return cls(k, torch.zeros_like(k))
        return cls(k, torch.zeros((*shape[:4], v_dim), dtype=dtype, device=device))

    @property
    def n_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def n_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def max_len(self) -> int:
        return int(self.k.shape[3])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[4])

    @property
    def v_dim(self) -> int:
        return int(self.v.shape[4])

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values, and the recurrent states if any)."""
        held = 0 if self.recurrent is None else self.recurrent.nbytes
        return int(self.k.nbytes + self.v.nbytes) + held

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` ``[B, KV, S, Dh]`` at ``[start, start+S)``; return K/V ``[0, start+S)``.

        The returned views never include positions ``>= start+S``: that is the rollback rule.
        """
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, KV, end, Dh]

    def update_at(self, layer: int, pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` ``[B, KV, S, Dh]`` at positions ``pos`` ``[S]`` (a device tensor);
        return all of K/V ``[B, KV, max_len, Dh]``.

        The static-shape twin of ``update`` for CUDA graphs: no Python int decides a shape or an
        offset, so one capture replays at any position. The caller's mask hides positions past
        the chunk (the same rollback rule, enforced by the mask instead of a slice).
        """
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        return self.k[layer], self.v[layer]  # [B, KV, max_len, Dh]

    def __repr__(self) -> str:
        return (
            f"KVCache(shape={tuple(self.k.shape)}, v_dim={self.v_dim}, dtype={self.k.dtype}, "
            f"device={self.k.device})"
        )

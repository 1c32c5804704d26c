"""Causal masks of a chunk: which cached positions each of its queries attends.

Boolean, ``True`` where a query sees a key; a sliding ``window`` (``None``: full attention)
keeps the last ``window`` positions up to the query's own. ``causal_mask`` is the eager
path's (keys ``[0, start+S)``), ``static_mask`` the CUDA-graph path's (keys: the whole cache,
``StageModel.forward_at``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_mask", "static_mask"]


def causal_mask(start: int, s: int, device: torch.device, window: int | None) -> Tensor:
    """``[S, start+S]``: query ``start+i`` sees key ``j`` iff ``j <= start+i`` (and
    ``j > start+i - window`` for a sliding ``window``)."""
    q_pos = torch.arange(start, start + s, device=device)[:, None]  # [S, 1]
    k_pos = torch.arange(start + s, device=device)[None, :]  # [1, start+S]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def static_mask(pos: Tensor, max_len: int, window: int | None) -> Tensor:
    """``[S, max_len]``: queries at ``pos`` ``[S]`` over a whole cache."""
    k_pos = torch.arange(max_len, device=pos.device)[None, :]  # [1, max_len]
    q_pos = pos[:, None]  # [S, 1]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window is not None else mask

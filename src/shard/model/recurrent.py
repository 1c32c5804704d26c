"""The state of a session's linear-attention layers, kept so that the session can roll back.

A Gated DeltaNet layer (``shard.model.deltanet``) carries a recurrent state ``[B, Hv, Dk, Dv]``
from position to position instead of a key and value per position, plus the last
``kernel - 1`` inputs of its short convolution. A state cannot be cut back to a position, and
shard rolls sessions back all the time: a verify chunk whose drafts are partly rejected is
followed by a chunk that starts inside it, pipelined chunks in flight are discarded, an audit
replays chunks in order. The rule stays the KV cache's (``shard.model.kvcache``): a forward at
``[start, start+S)`` reads only what positions ``< start`` left, so it must first find the
state *after position* ``start - 1``.

What is kept, per linear layer (measured against recomputing from the prompt, which costs a
whole prefill per rejected draft, and against a state per position, 2 MiB per position and
layer on Qwen3-Next-80B):

- the **live** state, after the last position written (the common case: the next chunk starts
  right after the last one, and nothing is recomputed);
- a **snapshot** of the state after every ``EVERY``-th position, the last ``n_snaps`` of them;
- a **ring** of the last ``ring`` positions' step inputs: the convolution's raw input (model
  dtype), and the normalised key, the value, the decay ``g`` and ``beta`` (fp32), exactly what
  one recurrence step reads.

To start at ``s`` behind the live state, the layer takes the snapshot after position
``(s // EVERY) * EVERY - 1`` (or zeros) and replays the ring's steps up to ``s - 1``: the
same ops on the same stored operands as when those positions first ran, so the state is the
same bits as an uninterrupted run's (``tests/test_qwen3_next.py``). A rollback deeper than
``ROLLBACK`` positions, or a chunk that skips positions, is refused with
``RecurrentRollbackError`` rather than computed from a wrong state; a stage refuses such a
chunk before it runs (``shard.stage.chunks.plan``: a "gap" fault, on which the coordinator
sends the session again from position 0, which needs nothing kept). ``ROLLBACK`` covers the
deepest rollback the coordinator makes with its defaults (``depth_max`` 4 chunks of
``k_max + 1`` = 9 rows in flight: 36 positions) with room to spare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from shard.model.config import ModelConfig

__all__ = [
    "EVERY",
    "ROLLBACK",
    "RecurrentCache",
    "RecurrentRollbackError",
    "layer_state_bytes",
    "recurrent_bytes",
    "recurrent_shape",
]

#: Positions between two snapshots: a rollback replays at most ``EVERY - 1`` steps.
EVERY = 32
#: The deepest rollback (positions written and then discarded) a session can make.
ROLLBACK = 128


class RecurrentRollbackError(ValueError):
    """A chunk starts where no kept state reaches: deeper than ``ROLLBACK`` behind the last
    position written, or past it (a gap)."""


def recurrent_shape(kernel: int) -> tuple[int, int]:
    """``(ring, n_snaps)``: the ring's positions and the snapshots kept, for a convolution of
    ``kernel`` taps (module docstring: the ring holds a rollback, the steps back to the
    snapshot before it and the convolution's history; the snapshots reach past it)."""
    return ROLLBACK + EVERY + kernel, ROLLBACK // EVERY + 2


def recurrent_bytes(
    *, heads: int, k_dim: int, v_dim: int, conv_dim: int, kernel: int, elem: int
) -> int:
    """Bytes one layer's ``RecurrentCache`` holds for one session, whatever its length
    (``elem``: bytes of a model-dtype number): the live state and the snapshots in fp32, the
    ring's convolution inputs in the model dtype and its step inputs in fp32."""
    ring, n_snaps = recurrent_shape(kernel)
    states = (1 + n_snaps) * heads * k_dim * v_dim * 4
    return states + ring * (conv_dim * elem + (heads * (k_dim + v_dim) + 2 * heads) * 4)


def layer_state_bytes(config: ModelConfig, elem: int) -> int:
    """Bytes one of ``config``'s linear-attention layers keeps per session (0 without any)."""
    la = config.linear_attn
    if la is None:
        return 0
    return recurrent_bytes(
        heads=la.n_v_heads, k_dim=la.k_head_dim, v_dim=la.v_head_dim, conv_dim=la.conv_dim,
        kernel=la.conv_kernel, elem=elem,
    )  # fmt: skip


class RecurrentCache:
    """The linear-attention layers of one stage for one session (module docstring).

    ``layer`` indexes this stage's linear layers in order (``StageModel.cache_slot``). Tensors:
    ``state`` ``[L, B, Hv, Dk, Dv]`` and ``snaps`` ``[L, N, B, Hv, Dk, Dv]`` in fp32,
    ``conv_in`` ``[L, B, W, C]`` in the model dtype, ``keys`` ``[L, B, W, Hv, Dk]``,
    ``values`` ``[L, B, W, Hv, Dv]``, ``gates`` ``[L, B, W, 2, Hv]`` (``g`` and ``beta``) in
    fp32. Positions are tracked per layer on the host (a layer's chunk reads them before it
    runs, never the device)."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        *,
        heads: int,
        k_dim: int,
        v_dim: int,
        conv_dim: int,
        kernel: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if n_layers < 1 or batch < 1 or kernel < 1:
            raise ValueError(f"RecurrentCache needs layers, batch and kernel >= 1: {n_layers}, "
                             f"{batch}, {kernel}")  # fmt: skip
        self.kernel = kernel
        self.ring, self.n_snaps = recurrent_shape(kernel)
        f32, w = torch.float32, self.ring
        lb = (n_layers, batch)
        self.state = torch.zeros((*lb, heads, k_dim, v_dim), dtype=f32, device=device)
        self.snaps = torch.zeros(
            (n_layers, self.n_snaps, batch, heads, k_dim, v_dim), dtype=f32, device=device
        )
        self.conv_in = torch.zeros((*lb, w, conv_dim), dtype=dtype, device=device)
        self.keys = torch.zeros((*lb, w, heads, k_dim), dtype=f32, device=device)
        self.values = torch.zeros((*lb, w, heads, v_dim), dtype=f32, device=device)
        self.gates = torch.zeros((*lb, w, 2, heads), dtype=f32, device=device)
        self.live = [-1] * n_layers  # the position the live state is after (-1: none yet)
        self.snap_at = [[-1] * self.n_snaps for _ in range(n_layers)]  # each snapshot's position
        self.ring_at = [[-1] * w for _ in range(n_layers)]  # each ring slot's position

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        n_layers: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> RecurrentCache:
        """A zeroed cache for ``n_layers`` of ``config``'s linear-attention layers."""
        la = config.linear_attn
        assert la is not None, "only a model with linear attention keeps a recurrent state"
        return cls(
            n_layers, batch, heads=la.n_v_heads, k_dim=la.k_head_dim, v_dim=la.v_head_dim,
            conv_dim=la.conv_dim, kernel=la.conv_kernel, dtype=dtype, device=device,
        )  # fmt: skip

    @staticmethod
    def check(cache: RecurrentCache | None, n_layers: int, batch: int) -> None:
        """``ValueError`` unless ``cache`` holds ``n_layers`` layers of ``batch`` (or is None
        where there are none)."""
        if (cache is None and n_layers == 0) or (
            cache is not None and (cache.n_layers, cache.batch) == (n_layers, batch)
        ):
            return
        raise ValueError(
            f"the cache's recurrent state {cache!r} does not hold this stage's {n_layers} "
            f"linear-attention layers for a batch of {batch}; make it with StageModel.new_cache"
        )

    @property
    def n_layers(self) -> int:
        return int(self.state.shape[0])

    @property
    def batch(self) -> int:
        return int(self.state.shape[1])

    @property
    def nbytes(self) -> int:
        tensors = (self.state, self.snaps, self.conv_in, self.keys, self.values, self.gates)
        return sum(int(t.nbytes) for t in tensors)

    def state_before(self, layer: int, start: int) -> tuple[Tensor, int]:
        """The state after position ``start - 1`` (a fresh tensor) and where to replay from:
        ``(state, first)`` means steps ``[first, start)`` still have to be replayed onto
        ``state`` from the ring (``step_inputs``). Errors: ``RecurrentRollbackError``."""
        live = self.live[layer]
        if start == 0:  # a session sent again from its start (a full re-send) needs nothing kept
            return torch.zeros_like(self.state[layer]), 0
        if start > live + 1:
            raise RecurrentRollbackError(
                f"a chunk at position {start} skips positions: this layer's state is after "
                f"position {live}; chunks of a session must follow each other"
            )
        if start == live + 1:
            return self.state[layer].clone(), start
        if live - start + 1 > ROLLBACK:
            raise RecurrentRollbackError(
                f"a chunk at position {start} rolls back {live - start + 1} positions: a "
                f"linear-attention session keeps its state {ROLLBACK} positions back at most"
            )
        first = (start // EVERY) * EVERY  # the snapshot is the state after first - 1
        if first == 0:
            base = torch.zeros_like(self.state[layer])
        else:
            slot = (first // EVERY) % self.n_snaps
            if self.snap_at[layer][slot] != first - 1:
                raise RecurrentRollbackError(f"no snapshot after position {first - 1} is kept")
            base = self.snaps[layer, slot].clone()
        self._check_ring(layer, first, start)
        return base, first

    def _check_ring(self, layer: int, first: int, end: int) -> None:
        at = self.ring_at[layer]
        missing = [p for p in range(max(first, 0), end) if at[p % self.ring] != p]
        if missing:
            raise RecurrentRollbackError(
                f"positions {missing[0]}..{missing[-1]} are no longer kept for a rollback"
            )

    def step_inputs(self, layer: int, pos: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The stored ``k [B, Hv, Dk]``, ``v [B, Hv, Dv]``, ``g [B, Hv]``, ``beta [B, Hv]``
        of position ``pos`` (fp32)."""
        slot = pos % self.ring
        gates = self.gates[layer, :, slot]  # [B, 2, Hv]
        return self.keys[layer, :, slot], self.values[layer, :, slot], gates[:, 0], gates[:, 1]

    def conv_history(self, layer: int, start: int) -> Tensor:
        """The convolution's raw inputs at positions ``[start - kernel + 1, start)``:
        ``[B, kernel - 1, C]``, zeros before position 0 (the convolution's own padding)."""
        rows = []
        self._check_ring(layer, start - self.kernel + 1, start)
        for p in range(start - self.kernel + 1, start):
            if p < 0:
                rows.append(torch.zeros_like(self.conv_in[layer, :, 0]))
            else:
                rows.append(self.conv_in[layer, :, p % self.ring])
        return torch.stack(rows, dim=1)  # [B, K-1, C]

    def keep(
        self, layer: int, start: int, conv_in: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
    ) -> None:
        """Store positions ``[start, start+S)``'s step inputs in the ring: ``conv_in``
        ``[B, S, C]``; ``k`` ``[B, Hv, S, Dk]``, ``v`` ``[B, Hv, S, Dv]``, ``g`` and ``beta``
        ``[B, Hv, S]`` (fp32; only the last ``ring`` positions of a long chunk are kept)."""
        s = int(conv_in.shape[1])
        at = self.ring_at[layer]
        for i in range(max(0, s - self.ring), s):
            slot = (start + i) % self.ring
            self.conv_in[layer, :, slot] = conv_in[:, i]
            self.keys[layer, :, slot] = k[:, :, i]
            self.values[layer, :, slot] = v[:, :, i]
            self.gates[layer, :, slot, 0] = g[:, :, i]
            self.gates[layer, :, slot, 1] = beta[:, :, i]
            at[slot] = start + i

    def snapshot(self, layer: int, pos: int, state: Tensor) -> None:
        """Keep ``state``, the state after ``pos``, when ``pos + 1`` is a multiple of
        ``EVERY``."""
        if (pos + 1) % EVERY == 0:
            slot = ((pos + 1) // EVERY) % self.n_snaps
            self.snaps[layer, slot] = state
            self.snap_at[layer][slot] = pos

    def set_live(self, layer: int, pos: int, state: Tensor) -> None:
        """``state`` is the state after ``pos``, the last position written."""
        self.state[layer] = state
        self.live[layer] = pos

    def __repr__(self) -> str:
        return (
            f"RecurrentCache(layers={self.n_layers}, batch={self.batch}, ring={self.ring}, "
            f"snaps={self.n_snaps}, state={tuple(self.state.shape[2:])})"
        )

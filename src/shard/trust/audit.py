"""Spot checks, the pure core: the coordinator's seed commitment, which chunks are audited,
and how an auditor's recomputation is compared with what a stage claimed.

A receipt proves coverage, not correctness: a stage that skips a layer signs a valid receipt.
An audit re-runs one chunk of a stage's block on another node holding the same block, from
the inputs the predecessor keeps, and compares.

- **Commitment.** Before the job the coordinator draws a 32-byte ``seed`` and sends
  ``commit(seed)`` as the job's nonce (``audit_nonce``), which every stage's receipt signs;
  it reveals the seed with the audit. The seed cannot be chosen after the fact to pick a
  chunk the coordinator likes, and the stage never learns it in time.
- **Choice.** Chunk *i* is audited iff ``pick(seed, chain_i) < rate``, where ``chain_i`` is the
  stage's output chain just after chunk *i* — a value the stage fixed when it sent the chunk.
  The stage knows its chain but not the seed, so every chunk is audited with probability
  ``rate``, independently of everything the stage can see: lying on any chunk is caught at
  that rate, whatever the stage does around it.
- **Comparison.** Where the stage and the auditor declare the same device class and dtype,
  replay is bit-exact (same weights, same chunk shapes and order, deterministic kernels): the
  results must hash the same. Otherwise rounding differs honestly, and each position's output
  row is projected to ``dims`` dimensions by a Gaussian matrix seeded from the revealed seed;
  the smallest per-row cosine between the two sketches must reach ``threshold``. Per row, so a
  lie on one position is not diluted by honest ones; seeded after the fact, so a stage cannot
  hide a lie in the projection's null space. The threshold and its measured margins are in
  ``docs/security.md``.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Final

import attrs
import torch

from shard.messages import Tensor as WireTensor
from shard.messages.audit import Blob
from shard.stage.tensors import from_wire, to_wire

__all__ = [
    "DEFAULT_DIMS",
    "DEFAULT_RATE",
    "DEFAULT_THRESHOLD",
    "Comparison",
    "audit_nonce",
    "blob_of",
    "commit",
    "compare",
    "is_audited",
    "new_seed",
    "pick",
    "sketch",
    "tensor_of",
]

DEFAULT_RATE: Final = 0.05
DEFAULT_DIMS: Final = 256
DEFAULT_THRESHOLD: Final = 0.99
SEED_BYTES: Final = 32


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=32).digest()


def new_seed() -> bytes:
    """A fresh audit seed (secret until the audit reveals it)."""
    return secrets.token_bytes(SEED_BYTES)


def commit(seed: bytes) -> str:
    """The commitment sent before the job: a domain-separated hash of the seed (hex)."""
    return _h(b"shard-audit-commit-v1", seed).hex()


def audit_nonce(commitment: str) -> str:
    """The job nonce a coordinator that audits sends (32 hex digits): derived from the
    commitment, so every stage's signed receipt (which signs the nonce) fixes the commitment
    before the stage computes anything — a seed cannot be swapped in afterwards."""
    return _h(b"shard-audit-nonce-v1", bytes.fromhex(commitment)).hex()[:32]


def pick(seed: bytes, chain_after: str) -> float:
    """A number uniform in [0, 1) fixed by the seed and the stage's output chain just after
    the chunk: the chunk is audited when it is below the rate."""
    digest = _h(b"shard-audit-pick-v1", seed, bytes.fromhex(chain_after))
    return int.from_bytes(digest[:8], "little") / float(1 << 64)


def is_audited(seed: bytes, chain_after: str, rate: float) -> bool:
    return pick(seed, chain_after) < rate


def blob_of(t: torch.Tensor | WireTensor) -> Blob:
    """A tensor as evidence holds it (row-major bytes, base64)."""
    w = t if isinstance(t, WireTensor) else to_wire(t)
    return Blob(w.dtype, w.shape, base64.b64encode(w.data).decode("ascii"))


def wire_of(blob: Blob) -> WireTensor:
    """The wire payload of a ``Blob``. Errors: ``ValueError`` for bad base64."""
    try:
        data = base64.b64decode(blob.b64.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"tensor payload is not base64: {exc}") from None
    return WireTensor(blob.dtype, tuple(blob.shape), data)


def tensor_of(blob: Blob) -> torch.Tensor:
    """The tensor of a ``Blob``. Errors: ``ValueError`` for a bad dtype, length or base64."""
    return from_wire(wire_of(blob))


def _projection(seed: bytes, dim: int, dims: int) -> torch.Tensor:
    """The ``[dim, dims]`` float64 Gaussian projection the revealed seed fixes."""
    key = _h(b"shard-audit-sketch-v1", seed, dim.to_bytes(8, "little"), dims.to_bytes(8, "little"))
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randn((dim, dims), generator=gen, dtype=torch.float64)


def sketch(hidden: torch.Tensor, seed: bytes, dims: int = DEFAULT_DIMS) -> torch.Tensor:
    """Each position's row of ``hidden`` (``[..., D]``) projected to ``dims``: ``[rows, dims]``
    in float64."""
    rows = hidden.detach().to("cpu", torch.float64).reshape(-1, hidden.shape[-1])  # [R, D]
    return rows @ _projection(seed, int(hidden.shape[-1]), dims)  # [R, dims]


def _min_row_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The smallest cosine between matching rows; 1.0 where both rows are zero, 0.0 where one
    is (a zero row against a live one is as different as rows get)."""
    na, nb = a.norm(dim=1), b.norm(dim=1)
    dot = (a * b).sum(dim=1)
    both_zero = (na == 0) & (nb == 0)
    cos = torch.where(
        both_zero, torch.ones_like(dot), dot / (na * nb).clamp_min(torch.finfo(torch.float64).tiny)
    )
    return float(cos.min()) if cos.numel() else 1.0


@attrs.frozen
class Comparison:
    """How a claimed result compared with the auditor's: ``ok`` False is a failed audit."""

    method: str  # "exact" | "sketch"
    ok: bool
    cosine: float | None  # the smallest per-row cosine (sketch only)
    detail: str


def compare(
    claimed: WireTensor,
    recomputed: WireTensor,
    *,
    exact: bool,
    seed: bytes,
    dims: int = DEFAULT_DIMS,
    threshold: float = DEFAULT_THRESHOLD,
) -> Comparison:
    """Compare a stage's output with the auditor's recomputation (see the module docstring).

    A different shape fails either way. ``exact`` compares the bytes (dtype included); the
    sketch path compares values whatever the two dtypes. A claimed payload that is not a valid
    tensor (wrong length for its shape, unknown dtype) fails: a stage's output must be one.
    """
    method = "exact" if exact else "sketch"
    if tuple(claimed.shape) != tuple(recomputed.shape):
        detail = f"shape {claimed.shape} differs from the recomputed {recomputed.shape}"
        return Comparison(method, False, None, detail)
    if exact:
        same = claimed.dtype == recomputed.dtype and _h(claimed.data) == _h(recomputed.data)
        detail = "bit-exact" if same else "the output's bytes differ from the recomputation's"
        return Comparison(method, same, None, detail)
    try:
        a, b = from_wire(claimed), from_wire(recomputed)
    except ValueError as exc:
        return Comparison(method, False, None, f"the claimed output is not a tensor: {exc}")
    if not (a.is_floating_point() and b.is_floating_point()):
        return Comparison(method, False, None, "hidden states must be floating point")
    finite = bool(torch.isfinite(a).all())
    cosine = _min_row_cosine(sketch(a, seed, dims), sketch(b, seed, dims)) if finite else 0.0
    ok = finite and cosine >= threshold
    relation = ">=" if ok else "<"
    return Comparison(method, ok, cosine, f"min row cosine {cosine:.6f} {relation} {threshold}")

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
  hide a lie in the projection's null space. The threshold is calibrated, not a constant
  (``calibrated_threshold``): 1 − the largest honest gap measured between a batched stage (or
  another kernel order, or another dtype) and a lone recomputation at the two ends'
  precision, times a margin (``HONEST_GAP``, ``GAP_MARGIN``; ``bench/audit_calibration.py``
  measures it, ``docs/security.md`` has the figures).
- **The tail** ("tokens"). Its output is a verdict (target ids, accepted count), compared
  for equality with the auditor's choice, made from the auditor's logits by the tail's own
  function (``shard.decode.verify``: greedy argmax, or a draw keyed by (seed, position), so
  a sampled choice is reproducible too). Where rounding differs honestly (batching, another
  device or dtype) two honest ends can choose differently at a near-tie, so a differing
  token is a strike only if the claimed token would still not be chosen with its logit
  raised by ``margin`` over the auditor's (``tie`` otherwise): no honest tail whose logits
  are within ``margin / 2`` of the auditor's in every entry is accused. Bit-exact replay
  allows no margin (0). A verdict whose tokens agree but whose accepted count or length does
  not is a lie whatever the margin (the walk over the drafts is a function of the tokens).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Final

import attrs
import torch

from shard.compute.tensors import from_wire, to_wire
from shard.decode.verify import choose_token, verify_chunk
from shard.messages import Sampling
from shard.messages import Tensor as WireTensor
from shard.messages.audit import AuditedChunk, Blob

__all__ = [
    "DEFAULT_DIMS",
    "DEFAULT_RATE",
    "GAP_MARGIN",
    "HONEST_GAP",
    "Comparison",
    "audit_nonce",
    "blob_of",
    "calibrated_threshold",
    "choice_rows",
    "commit",
    "compare",
    "compare_tokens",
    "is_audited",
    "new_seed",
    "pick",
    "sketch",
    "tail_choice",
    "tensor_of",
    "verdict_at",
    "verdict_blob",
    "verdict_of",
]

DEFAULT_RATE: Final = 0.05
DEFAULT_DIMS: Final = 256
SEED_BYTES: Final = 32

#: The largest 1 − (smallest per-row sketch cosine) measured between an honest stage and a
#: lone recomputation (``bench/audit_calibration.py``, ``bench/results/audit_calibration.json``;
#: the tiny test models and SmolLM2, CPU): "float32" where both ends compute in float32 or
#: finer — a batched forward against a lone one, 4.9e-13 at most (float32 against float64:
#: 1.9e-13, ``tests/test_audit.py``); "bfloat16" where either end computes in a 16-bit dtype —
#: a bf16 end against a float32 one, 3.8e-4 at most (3.7e-4 in ``tests/test_audit.py``'s
#: 1,100 audits; bf16 against bf16 batched on the CPU is bit for bit at these shapes, but is
#: not measured on a GPU, so it takes the mixed figure).
HONEST_GAP: Final = {"float32": 4.9e-13, "bfloat16": 3.8e-4}
#: How far past the honest gap a sketch may be before it is a lie (in 1 − cosine; the square
#: root is the margin in amplitude: ~32x and ~3.2x). At float32 the tolerance, 4.9e-10, is
#: still 500x below what noise at 1e-3 of the output's std gives (2.5e-7).
GAP_MARGIN: Final = {"float32": 1000.0, "bfloat16": 10.0}
_FINE: Final = frozenset({"float32", "float64"})


def calibrated_threshold(stage_dtype: str, auditor_dtype: str) -> float:
    """The smallest per-row sketch cosine an honest stage computing in ``stage_dtype`` reaches
    against an auditor in ``auditor_dtype`` (dtype names as ``torch.float32`` prints them,
    without ``torch.``), by ``HONEST_GAP`` and ``GAP_MARGIN``."""
    coarse = "float32" if {stage_dtype, auditor_dtype} <= _FINE else "bfloat16"
    return 1.0 - GAP_MARGIN[coarse] * HONEST_GAP[coarse]


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

    method: str  # "exact" | "sketch" | "tokens"
    ok: bool
    cosine: float | None  # the smallest per-row cosine (sketch only)
    detail: str
    tie: bool = False  # tokens: they differ only at a near-tie (ok, no strike)


def compare(
    claimed: WireTensor,
    recomputed: WireTensor,
    *,
    exact: bool,
    seed: bytes,
    dims: int = DEFAULT_DIMS,
    threshold: float,
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
    gap, tolerance = 1.0 - cosine, 1.0 - threshold
    detail = f"min row cosine 1 - {gap:.3e} {relation} the threshold 1 - {tolerance:.3e}"
    return Comparison(method, ok, cosine, detail)


def _rows(chunk: AuditedChunk) -> int:
    return len(chunk.ids) if chunk.hidden is None else int(chunk.hidden.shape[1])


def choice_rows(chunk: AuditedChunk) -> int:
    """Rows of ``chunk`` whose logits the tail's choice reads (``shard.stage.batch.head_rows``):
    none for a prefill chunk before the last, one for the last, ``K+1`` for a verify chunk."""
    if chunk.verify:
        return len(chunk.draft) + 1
    return 1 if chunk.final else 0


def verdict_at(chunk: AuditedChunk) -> tuple[int, bool]:
    """(absolute position of the verdict's first id, whether it answered the prompt): what the
    tail's receipt keys a verdict by (``shard.trust.receipts.verdict_payload``)."""
    if chunk.verify:
        return chunk.start + 1, False
    return chunk.start + _rows(chunk), True


def verdict_blob(target_ids: tuple[int, ...], accepted: int) -> Blob:
    """A verdict as evidence holds it: int64 ``[*target_ids, accepted]``."""
    return blob_of(torch.tensor([*target_ids, accepted], dtype=torch.int64))


def verdict_of(blob: Blob | WireTensor) -> tuple[tuple[int, ...], int]:
    """(target ids, accepted) of a ``verdict_blob``. Errors: ``ValueError`` for anything else."""
    t = from_wire(blob if isinstance(blob, WireTensor) else wire_of(blob))
    if t.dtype != torch.int64 or t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"a verdict is int64 [ids..., accepted], not {t.dtype} {tuple(t.shape)}")
    values = [int(v) for v in t.tolist()]
    return tuple(values[:-1]), values[-1]


def tail_choice(
    logits: torch.Tensor, chunk: AuditedChunk, sampling: Sampling
) -> tuple[tuple[int, ...], int]:
    """The tail's verdict from its chunk's last ``choice_rows`` rows of logits ``[R, V]``, as
    ``shard.stage.batch`` makes it (a prefill chunk is one row with no draft)."""
    at, prefill = verdict_at(chunk)
    rows = logits.to("cpu", torch.float32)  # [R, V]
    if prefill:
        return (choose_token(rows[-1], sampling, at),), 0
    verdict = verify_chunk(rows, chunk.draft, sampling, at, chunk.q)
    return verdict.target_ids, verdict.accepted


def compare_tokens(
    claimed: Blob | WireTensor,
    logits: torch.Tensor,
    chunk: AuditedChunk,
    sampling: Sampling,
    *,
    margin: float,
) -> Comparison:
    """Compare the tail's claimed verdict with the choice from the auditor's ``logits``
    ``[choice_rows(chunk), V]`` (see the module docstring: equality, ties within ``margin``)."""
    try:
        ids, accepted = verdict_of(claimed)
    except ValueError as exc:
        return Comparison("tokens", False, None, f"the claimed output is not a verdict: {exc}")
    if logits.dim() != 2 or logits.shape[0] != choice_rows(chunk) or not logits.shape[0]:
        return Comparison("tokens", False, None, f"logits {tuple(logits.shape)} fit no choice")
    mine, my_accepted = tail_choice(logits, chunk, sampling)
    if (ids, accepted) == (mine, my_accepted):
        return Comparison("tokens", True, None, "the same verdict")
    at, _ = verdict_at(chunk)
    j = next((i for i, (a, b) in enumerate(zip(ids, mine, strict=False)) if a != b), None)
    said = f"claimed {ids} (accepted {accepted}), recomputed {mine} (accepted {my_accepted})"
    if j is None:  # the same tokens, another walk: no rounding explains it
        return Comparison("tokens", False, None, f"{said}: not the walk its tokens make")
    token, vocab = ids[j], int(logits.shape[1])
    if 0 <= token < vocab:
        boosted = logits.to("cpu", torch.float32).clone()  # [R, V]
        boosted[j, token] += margin
        # the whole walk again (a sampled draft's rule reads the row through p/q, not argmax)
        if tail_choice(boosted, chunk, sampling)[0][j : j + 1] == (token,):
            detail = f"{said}: a near-tie at position {at + j} (within margin {margin})"
            return Comparison("tokens", True, None, detail, tie=True)
    return Comparison(
        "tokens", False, None, f"{said}: position {at + j} is not within margin {margin}"
    )

"""The metering ledger: who computed what, from a folder of run receipts — the pure core of
``shard ledger`` (reading the folder and printing are ``shard.cli.ledger``).

``build_ledger(files, pins, period)`` takes ``(name, bytes)`` pairs, and for each in name
order parses it strictly (``receipt_from_json``), verifies it with the pins
(``verify_run``, the checks ``shard receipt verify`` makes) and counts it — or refuses it
with one line saying why. Refused, never counted:

- a file that is not a receipt, too large, nested too deep, of the wrong types, or that fails
  verification (a forged signature, an altered field);
- a receipt no pin vouches for: under ``authority`` every signer must be admitted by it (as
  ``receipt verify --authority``), and the coordinator's key must be one of ``coordinators``
  when any are given. With neither pin every receipt is refused: anyone's keys make one;
- a **duplicate** (the same bytes as a file counted before), a **replay** (a job already
  counted, in other bytes: re-signed, or another coordinator's copy), a receipt that
  **reuses a nonce** already counted (the stages signed that nonce for one job only), and a
  second receipt of one **request**: a run that resumed a request a dead coordinator began
  (``RunReceipt.resumes``) belongs to the request's first job, so it and a receipt of that
  job (or of another resume of it) are one request, counted once. The first file in name
  order is the one counted.

What a receipt credits (``credits``): each stage that signed it, for its block
(``layers`` = last - first), the chunks it computed and sent on (``chunks_out``), its compute
seconds, the prompt (``prefill_tokens``, the tail's prompt length) and the output tokens
generated while it held its block (``decode_tokens``). ``layer_tokens`` is (prefill + decode
tokens) x layers. A block spliced mid-run (``RunReceipt.splices``) is split at the splice:
the standby gets what it signed and the output from ``at_token`` on; the node it replaced —
which signed nothing, having died — gets the rest, in chunks as its successor counted them
(the successor's received chunks less the standby's), the prompt if the splice came after
the first output token, and the ``at_token`` tokens before it; its key is unknown (``""``).
The request's own tokens (``Totals.tokens``) are counted once, whatever the ring did. A
resumed run's receipt covers its own run: its prompt is the request's prompt and the tokens
committed before the restart (it recomputed them), its output the rest; the tokens before the
restart were signed by nobody (the first coordinator died): no node is credited for them,
and ``Totals.unsigned_tokens`` counts them (delivered, unsigned), so ``tokens`` plus it is
what the clients received.

Receipts carry no audit outcome: spot-check strikes are signed evidence files
(``shard receipt verify --evidence``), so the ledger has no audited-chunks or strikes column.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Iterable

import attrs

from shard.messages import RunReceipt
from shard.trust.identity import short
from shard.trust.receipt_check import (
    ReceiptPins,
    receipt_from_json,
    splices_by_block,
    verify_run,
)
from shard.trust.receipts import ReceiptInvalid

__all__ = [
    "MAX_RECEIPT_BYTES",
    "PERIODS",
    "Credit",
    "Ledger",
    "LedgerPins",
    "Refused",
    "Row",
    "Totals",
    "build_ledger",
    "credits",
    "period_of",
    "request_of",
]

#: A receipt file larger than this is refused unread (a run of 8,192 tokens is ~2 MiB).
MAX_RECEIPT_BYTES = 32 << 20
PERIODS = ("hour", "day", "all")


@attrs.frozen
class LedgerPins:
    """Who may have signed: the swarm authority (every signer) and/or coordinator keys."""

    authority: bytes | None = None
    coordinators: frozenset[bytes] = frozenset()
    revoked: Collection[int] = frozenset()


@attrs.frozen
class Credit:
    """One node's share of one request."""

    node: str
    key: str  # the key it signed with; "" for a replaced node, which signed nothing
    layers: int
    chunks: int
    prefill_tokens: int
    decode_tokens: int
    compute_s: float


@attrs.frozen
class Row:
    """One node's work in one period, summed over the requests counted."""

    period: str
    node: str
    keys: tuple[str, ...]
    requests: int
    chunks: int
    prefill_tokens: int
    decode_tokens: int
    tokens: int  # prefill + decode tokens
    layer_tokens: int  # tokens x the layers held for them
    compute_s: float


@attrs.frozen
class Totals:
    receipts: int  # counted
    refused: int
    tokens: int  # generated tokens, once per request
    prompt_tokens: int  # once per request
    layer_tokens: int  # every node's, summed
    chunks: int
    #: tokens a resumed request had committed before its coordinator died: delivered to the
    #: client, signed by nobody (``resumes.at_token``); tokens + these = what clients received
    unsigned_tokens: int = 0


@attrs.frozen
class Refused:
    file: str
    reason: str


@attrs.frozen
class Ledger:
    period: str
    rows: tuple[Row, ...]
    totals: Totals
    refused: tuple[Refused, ...]


def period_of(signed_at: int, period: str) -> str:
    """The period a receipt signed at ``signed_at`` (Unix seconds) falls in, UTC:
    ``2026-12-05T14Z`` (hour), ``2026-12-05`` (day) or ``all``."""
    if period == "all":
        return "all"
    t = time.gmtime(signed_at)
    return time.strftime("%Y-%m-%dT%HZ" if period == "hour" else "%Y-%m-%d", t)


def request_of(receipt: RunReceipt) -> str:
    """The request a receipt is of: the job it resumes, if it names one, else its own."""
    rs = receipt.resumes
    return rs.job if rs is not None and rs.job else receipt.job


def _prompt_len(receipt: RunReceipt) -> int:
    """The prompt's length: where the tail's answer to the prompt sits (verified unique)."""
    return next(v.at for v in receipt.verdicts if v.prefill)


def credits(receipt: RunReceipt) -> list[Credit]:
    """Each node's share of a *verified* receipt (see the module docstring)."""
    prompt, out = _prompt_len(receipt), len(receipt.output_ids)
    splices = splices_by_block(receipt)
    stages = receipt.stages
    found: list[Credit] = []
    for i, s in enumerate(stages):
        layers = s.last - s.first
        sp = splices.get(s.first)
        if sp is None:
            found.append(
                Credit(s.node, s.public_key, layers, s.chunks_out, prompt, out, s.compute_s)
            )
            continue
        received = stages[i + 1].chunks_in if i + 1 < len(stages) else len(receipt.verdicts)
        before = sp.at_token
        found.append(
            Credit(
                sp.replaced,
                "",
                layers,
                received - s.chunks_out,
                prompt if before else 0,
                before,
                0.0,
            )
        )
        found.append(
            Credit(
                s.node,
                s.public_key,
                layers,
                s.chunks_out,
                0 if before else prompt,
                out - before,
                s.compute_s,
            )
        )
    return found


def _pinned(receipt: RunReceipt, pins: LedgerPins) -> None:
    """Verify with the pins. Errors: ``ReceiptInvalid`` saying why."""
    if pins.authority is None and not pins.coordinators:
        raise ReceiptInvalid("no pin given: anyone's keys could have made this receipt")
    verify_run(receipt, ReceiptPins(authority=pins.authority, revoked=pins.revoked))
    key = bytes.fromhex(receipt.coordinator_key)  # hex checked by verify_run
    if pins.coordinators and key not in pins.coordinators:
        raise ReceiptInvalid(
            f"signed by coordinator {receipt.coordinator} with key {short(key)}, which is not "
            "a pinned coordinator (--coordinator)"
        )


@attrs.define
class _Book:
    """What was counted so far, to name duplicates and replays."""

    digests: dict[bytes, str] = attrs.field(factory=dict)
    jobs: dict[str, str] = attrs.field(factory=dict)
    nonces: dict[str, str] = attrs.field(factory=dict)
    requests: dict[str, str] = attrs.field(factory=dict)

    def seen(self, name: str, data: bytes, receipt: RunReceipt | None) -> str | None:
        digest = hashlib.blake2b(data, digest_size=32).digest()
        if digest in self.digests:
            return f"duplicate: the same bytes as {self.digests[digest]}, counted already"
        if receipt is None:
            return None
        if receipt.job in self.jobs:
            return f"replayed: job {receipt.job} was counted already from {self.jobs[receipt.job]}"
        if receipt.nonce in self.nonces:
            return (
                f"replayed: nonce {receipt.nonce} was counted already from "
                f"{self.nonces[receipt.nonce]} (the stages signed it for one job)"
            )
        if (request := request_of(receipt)) in self.requests:
            return (
                f"replayed: request {request} (a job and the runs resuming it) was counted "
                f"already from {self.requests[request]}"
            )
        return None

    def count(self, name: str, data: bytes, receipt: RunReceipt) -> None:
        self.digests[hashlib.blake2b(data, digest_size=32).digest()] = name
        self.jobs[receipt.job] = name
        self.nonces[receipt.nonce] = name
        self.requests[request_of(receipt)] = name


def _read(name: str, data: bytes, pins: LedgerPins, book: _Book) -> RunReceipt:
    """One file, parsed, deduplicated and verified. Errors: ``ReceiptInvalid``."""
    if len(data) > MAX_RECEIPT_BYTES:
        raise ReceiptInvalid(f"more than {MAX_RECEIPT_BYTES} bytes: larger than any receipt")
    if (why := book.seen(name, data, None)) is not None:
        raise ReceiptInvalid(why)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ReceiptInvalid("not UTF-8 text: not a receipt file") from None
    receipt = receipt_from_json(text)
    _pinned(receipt, pins)
    if (why := book.seen(name, data, receipt)) is not None:
        raise ReceiptInvalid(why)
    return receipt


def build_ledger(
    files: Iterable[tuple[str, bytes]],
    pins: LedgerPins,
    period: str,
    *,
    unreadable: Iterable[tuple[str, str]] = (),
) -> Ledger:
    """The ledger of ``files`` (name, content) over ``period`` (one of ``PERIODS``);
    ``unreadable`` (name, why) are files the caller could not read, refused as such."""
    if period not in PERIODS:
        raise ValueError(f"period {period!r}: one of {', '.join(PERIODS)}")
    book, refused = _Book(), [Refused(name, why) for name, why in unreadable]
    rows: dict[tuple[str, str], _Sum] = {}
    tokens = prompt = counted = unsigned = 0
    for name, data in sorted(files):
        try:
            receipt = _read(name, data, pins, book)
        except ReceiptInvalid as exc:
            refused.append(Refused(name, " ".join(str(exc).split())))
            continue
        book.count(name, data, receipt)
        counted += 1
        tokens += len(receipt.output_ids)
        unsigned += receipt.resumes.at_token if receipt.resumes is not None else 0
        prompt += _prompt_len(receipt)
        when = period_of(receipt.signed_at, period)
        for c in credits(receipt):
            rows.setdefault((when, c.node), _Sum()).add(c)
    out = tuple(s.row(when, node) for (when, node), s in sorted(rows.items()))
    totals = Totals(
        receipts=counted,
        refused=len(refused),
        tokens=tokens,
        prompt_tokens=prompt,
        layer_tokens=sum(r.layer_tokens for r in out),
        chunks=sum(r.chunks for r in out),
        unsigned_tokens=unsigned,
    )
    return Ledger(period, out, totals, tuple(sorted(refused, key=lambda r: r.file)))


@attrs.define
class _Sum:
    keys: set[str] = attrs.field(factory=set)
    requests: int = 0
    chunks: int = 0
    prefill: int = 0
    decode: int = 0
    layer_tokens: int = 0
    compute_s: float = 0.0

    def add(self, c: Credit) -> None:
        if c.key:
            self.keys.add(c.key)
        self.requests += 1
        self.chunks += c.chunks
        self.prefill += c.prefill_tokens
        self.decode += c.decode_tokens
        self.layer_tokens += (c.prefill_tokens + c.decode_tokens) * c.layers
        self.compute_s += c.compute_s

    def row(self, period: str, node: str) -> Row:
        return Row(
            period,
            node,
            tuple(sorted(self.keys)),
            self.requests,
            self.chunks,
            self.prefill,
            self.decode,
            self.prefill + self.decode,
            self.layer_tokens,
            round(self.compute_s, 6),
        )

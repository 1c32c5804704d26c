"""``shard ledger DIR``: read a folder of run receipts, meter them with ``shard.trust.ledger``
and print the ledger as a table, JSON or CSV. 0 when every file counted, 1 when any was
refused or the folder cannot be read, 2 for bad arguments (no pin, an unreadable key). The
arguments are declared in ``shard.cli.args.ledger``."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ledger", "read_folder"]

_COLUMNS = (
    "period",
    "node",
    "requests",
    "chunks",
    "prefill_tokens",
    "decode_tokens",
    "tokens",
    "layer_tokens",
    "compute_s",
)


def ledger(args: argparse.Namespace) -> int:
    from shard.cli.errors import UsageError
    from shard.trust.identity import IdentityError, read_public_key
    from shard.trust.ledger import LedgerPins, build_ledger

    if not args.authority and not args.coordinator:
        raise UsageError(
            "give --authority PUB (secure swarm) or --coordinator PUB: a ledger of unpinned "
            "receipts would credit whoever made them"
        )
    try:
        pins = LedgerPins(
            authority=read_public_key(args.authority) if args.authority else None,
            coordinators=frozenset(read_public_key(c) for c in args.coordinator),
            revoked=frozenset(int(s) for s in args.revoked.split(",") if s.strip()),
        )
    except (IdentityError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    files, unreadable = read_folder(Path(args.dir))
    book = build_ledger(files, pins, args.period, unreadable=unreadable)
    if args.json:
        print(json.dumps(attrs.asdict(book), indent=2, sort_keys=True))
    elif args.csv:
        _print_csv(book)
    else:
        _print_table(book, args.dir)
    if book.refused:
        total = book.totals.receipts + len(book.refused)
        print(f"shard ledger: {len(book.refused)} of {total} files refused", file=sys.stderr)
        return 1
    return 0


def read_folder(folder: Path) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
    """Every regular, not hidden file of ``folder`` (name, bytes — at most one byte past the
    largest receipt), and those that could not be read (name, why).

    Errors: ``InputError`` when ``folder`` is missing, not a folder or cannot be listed."""
    from shard.cli.errors import InputError
    from shard.trust.ledger import MAX_RECEIPT_BYTES

    try:
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        raise InputError(f"{folder}: no such folder") from None
    except NotADirectoryError:
        raise InputError(f"{folder}: not a folder (give the folder the receipts are in)") from None
    except OSError as exc:
        raise InputError(f"{folder}: cannot list the folder: {exc.strerror}") from None
    files: list[tuple[str, bytes]] = []
    unreadable: list[tuple[str, str]] = []
    for path in entries:
        if path.is_dir():
            continue
        try:
            with path.open("rb") as f:
                files.append((path.name, f.read(MAX_RECEIPT_BYTES + 1)))
        except OSError as exc:
            unreadable.append((path.name, f"cannot read the file: {exc.strerror}"))
    return files, unreadable


def _print_table(book: Any, folder: str) -> None:
    t = book.totals
    print(
        f"ledger of {folder}: {t.receipts} receipts counted, {t.refused} refused "
        f"(period: {book.period})"
    )
    header = ("period", "node", "requests", "chunks", "prefill", "decode", "tokens", "layer-tok")
    lines = [(*header, "compute_s", "keys")]
    for r in book.rows:
        keys = " ".join(f"ed25519:{k[:16]}" for k in r.keys) or "(none: replaced)"
        numbers = (r.requests, r.chunks, r.prefill_tokens, r.decode_tokens, r.tokens)
        lines.append(
            (r.period, r.node, *map(str, numbers), str(r.layer_tokens), f"{r.compute_s:g}", keys)
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    for line in lines:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False))
            + "  "
            + line[-1]
        )
    print(
        f"totals: {t.receipts} requests, {t.tokens} tokens generated (once per request), "
        f"{t.prompt_tokens} prompt tokens, {t.layer_tokens} layer-tokens, {t.chunks} chunks"
        + _unsigned(t)
    )
    for r in book.refused:
        print(f"refused: {r.file}: {r.reason}")


def _unsigned(t: Any) -> str:
    if not t.unsigned_tokens:
        return ""
    return f"; {t.unsigned_tokens} tokens delivered before a coordinator died, signed by nobody"


def _print_csv(book: Any) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow((*_COLUMNS, "keys"))
    for r in book.rows:
        out.writerow((*(getattr(r, c) for c in _COLUMNS), " ".join(r.keys)))
    t = book.totals
    print(
        f"shard ledger: totals: {t.receipts} requests, {t.tokens} tokens, {t.prompt_tokens} "
        f"prompt tokens, {t.layer_tokens} layer-tokens, {t.chunks} chunks" + _unsigned(t),
        file=sys.stderr,
    )
    for r in book.refused:
        print(f"shard ledger: refused {r.file}: {r.reason}", file=sys.stderr)

"""``shard keygen``, ``shard admit``, ``shard receipt verify`` and ``shard api-key``: keys,
admission, receipts, and the HTTP API's bearer keys."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def keygen(args: argparse.Namespace) -> int:
    from shard.nodes.compose import keygen

    out = Path(args.out)
    _make_parent(out)
    return keygen(out)


def _make_parent(out: Path) -> None:
    """Create ``out``'s missing folders (``keys/`` in ``--out keys/s0.key``), private: they
    hold secret keys. An existing folder is left as it is.

    Errors: ``InputError`` when a folder cannot be created."""
    from shard.cli.errors import InputError

    try:
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out.parent}: cannot create the folder: {exc.strerror}") from None


def admit(args: argparse.Namespace) -> int:
    from shard.nodes.compose import admit

    _make_parent(Path(args.out))
    try:
        return admit(
            authority=Path(args.authority),
            node_pub=args.node_pub,
            swarm=args.swarm,
            roles=args.roles,
            expires=args.expires,
            out=Path(args.out),
            serial=args.serial,
        )
    except ValueError as exc:
        print(f"shard admit: error: {exc}", file=sys.stderr)
        return 2


def receipt(args: argparse.Namespace) -> int:
    from shard.trust.identity import IdentityError, read_public_key, short
    from shard.trust.receipt_check import ReceiptPins, receipt_from_json, verify_run
    from shard.trust.receipts import ReceiptInvalid

    if args.evidence is not None or args.file is None:
        return _evidence(args)
    try:
        pins = ReceiptPins(
            authority=read_public_key(args.authority) if args.authority else None,
            coordinator=read_public_key(args.coordinator) if args.coordinator else None,
            revoked=frozenset(int(s) for s in args.revoked.split(",") if s.strip()),
        )
    except (IdentityError, ValueError) as exc:
        print(f"shard receipt verify: error: {exc}", file=sys.stderr)
        return 2
    try:
        verified = verify_run(receipt_from_json(Path(args.file).read_text()), pins)
    except (OSError, UnicodeDecodeError, ReceiptInvalid) as exc:
        print(f"shard: receipt INVALID: {args.file}: {exc}", file=sys.stderr)
        return 1
    run = verified.receipt
    if verified.unpinned:
        trust = (
            f"signers NOT pinned: {', '.join(verified.unpinned)}; anyone's keys could have "
            "made this receipt: pass --authority PUB (secure swarm) or --coordinator PUB"
        )
    elif pins.authority is not None:
        trust = f"every signer admitted to swarm {run.swarm!r} by authority {short(pins.authority)}"
    else:
        trust = "signers pinned"
    stages = ", ".join(f"{s.node}[{s.first},{s.last})" for s in run.stages)
    if verified.stop_id is not None:
        ended = f"stopped at stop id {verified.stop_id} (max_tokens {run.max_tokens})"
    else:
        ended = f"ended at max_tokens {run.max_tokens}"
    print(
        f"receipt OK ({trust}): job {run.job}, {len(run.output_ids)} tokens, {ended}, "
        f"{run.n_layers} layers over {stages}; coordinator {run.coordinator} "
        f"ed25519:{run.coordinator_key[:16]}"
    )
    return 0


def _evidence(args: argparse.Namespace) -> int:
    """``shard receipt verify --evidence FILE``: 0 valid, 1 invalid, 2 bad arguments."""
    from shard.audit.evidence import (
        EvidenceInvalid,
        EvidencePins,
        evidence_from_json,
        verify_evidence,
    )
    from shard.trust.identity import IdentityError, read_public_key, short

    if args.evidence is None or args.file is not None:
        what = "give a receipt FILE or --evidence FILE (not both)"
        print(f"shard receipt verify: error: {what}", file=sys.stderr)
        return 2
    try:
        pins = EvidencePins(
            auditor=read_public_key(args.auditor) if args.auditor else None,
            authority=read_public_key(args.authority) if args.authority else None,
            revoked=frozenset(int(s) for s in args.revoked.split(",") if s.strip()),
        )
    except (IdentityError, ValueError) as exc:
        print(f"shard receipt verify: error: {exc}", file=sys.stderr)
        return 2
    try:
        checked = verify_evidence(evidence_from_json(Path(args.evidence).read_text()), pins)
    except (OSError, UnicodeDecodeError, EvidenceInvalid) as exc:
        print(f"shard: evidence INVALID: {args.evidence}: {exc}", file=sys.stderr)
        return 1
    ev = checked.evidence
    if ev.method == "tokens":
        how = f"the tail's verdict, margin {ev.margin}"
    elif ev.method == "exact":
        how = "bit-exact"
    else:
        how = f"sketch cosine {ev.cosine:.6f} < {ev.threshold}"
    bound = (
        "the accused's signed receipt backs its claim"
        if checked.bound
        else ("NO receipt of the accused: the auditor's word only")
    )
    pinned = f"; NOT pinned: {', '.join(checked.unpinned)}" if checked.unpinned else ""
    print(
        f"evidence OK: {ev.accused} [{ev.first}, {ev.last}) lied on chunk {ev.index} of session "
        f"{ev.session} ({how} mismatch); {bound}; auditor {ev.auditor} "
        f"{short(bytes.fromhex(ev.auditor_key))}{pinned}"
    )
    return 0


def api_key(args: argparse.Namespace) -> int:
    """Make an HTTP API key: its hash goes into the keys file, the key itself to stdout once."""
    from shard.api.keys import add_key

    key = add_key(Path(args.keys), args.label or "")
    print(key)
    print(
        f"shard api-key: added its hash to {args.keys}; the key is shown only now "
        "(clients send it as Authorization: Bearer KEY)",
        file=sys.stderr,
    )
    return 0

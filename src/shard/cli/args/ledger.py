"""``shard ledger``'s arguments (run by ``shard.cli.ledger``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser


def add_ledger(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "ledger",
        help="meter a folder of run receipts: who computed what, per node and period",
        description="Read every file in DIR (not hidden, not in subfolders) as a run receipt "
        "written by --receipt, verify each with the pins (as `shard receipt verify` does), and "
        "print per node and period what it computed: requests, chunks, prefill and decode "
        "tokens, tokens, layer-tokens (tokens x layers held) and compute seconds; then the "
        "totals (generated tokens counted once per request) and every refused file with why. "
        "Refused, never counted: a file that is not a receipt or fails verification (forged), "
        "one no pin vouches for, the same bytes twice (duplicate), and a job or nonce already "
        "counted (replayed); the first file in name order counts. A block spliced mid-run is "
        "split: the standby for what it signed, the node it replaced for the chunks its "
        "successor received before. Receipts carry no audit outcome: strikes are evidence "
        "files (`shard receipt verify --evidence`). Exit 0 when every file counted, 1 when "
        "any was refused or DIR cannot be read, 2 for bad arguments (no pin).",
    )
    p.add_argument("dir", metavar="DIR", help="a folder of receipt files (--receipt OUT)")
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: period, rows (one per node and period), totals, refused",
    )
    out.add_argument(
        "--csv",
        action="store_true",
        help="print the rows as CSV with a header (totals and refusals go to stderr)",
    )
    p.add_argument(
        "--period",
        choices=("hour", "day", "all"),
        default="all",
        help="group rows by the UTC hour or day each receipt was signed (default all)",
    )
    p.add_argument(
        "--authority",
        metavar="PUB",
        help="the swarm authority's public key (64 hex digits or a .pub file): every signer "
        "of a counted receipt carries its admission token",
    )
    p.add_argument(
        "--coordinator",
        metavar="PUB",
        action="append",
        default=[],
        help="a coordinator's public key (repeat for a standby coordinator): a counted "
        "receipt is signed by one of them; stage keys are then that coordinator's word",
    )
    p.add_argument(
        "--revoked",
        metavar="SERIALS",
        default="",
        help="with --authority: comma-separated token serials to refuse",
    )

"""``shard keygen``'s, ``api-key``'s, ``admit``'s and ``receipt verify``'s arguments (run by
``shard.cli.keys``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, bounded


def add_trust(sub: argparse._SubParsersAction[Parser]) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="create a node identity: an Ed25519 key (PATH, mode 0600) and PATH.pub",
        description="Write a new Ed25519 secret key to PATH (mode 0600) and its public key "
        "(64 hex digits) to PATH.pub. Never overwrites either file.",
    )
    keygen.add_argument("--out", required=True, help="where to write the secret key")
    api_key = sub.add_parser(
        "api-key",
        help="make a bearer key for the HTTP API: print it, append its hash to KEYS",
        description="Make a random API key, append its SHA-256 hash (and LABEL) to the keys "
        "file that [api] keys_file names, and print the key once on stdout. The file never "
        "holds the key itself.",
    )
    api_key.add_argument("--keys", required=True, help="the keys file ([api] keys_file)")
    api_key.add_argument("--label", help="a note kept beside the hash (who the key is for)")
    admit = sub.add_parser(
        "admit",
        help="as the swarm's authority, sign a token admitting a node's key",
        description="Sign an admission token binding a node's public key to a swarm, roles "
        "and a validity window, with the authority's key. Prints the token's serial (list it "
        "under [trust] revoked to revoke the token). Never overwrites OUT.",
    )
    admit.add_argument("--authority", required=True, help="the authority's secret key file")
    admit.add_argument("--node-pub", required=True, help="the node's .pub file or 64 hex digits")
    admit.add_argument("--swarm", required=True, help="swarm name (the spec's swarm.name)")
    admit.add_argument(
        "--roles",
        required=True,
        help="comma-separated: stage, coordinator, client, monitor; trusted (with stage: "
        "may hold the first and last blocks of a [formation] swarm with pin_boundaries)",
    )
    admit.add_argument("--expires", default="30d", help="lifetime: 30d, 12h, 90m, 2w (default 30d)")
    admit.add_argument(
        "--serial",
        type=bounded(int, 0, (1 << 63) - 1, "an integer >= 0"),
        help="token serial (default: random)",
    )
    admit.add_argument("--out", required=True, help="where to write the token")


def add_receipt(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser("receipt", help="check a signed run receipt offline")
    rsub = p.add_subparsers(dest="receipt_command", required=True, metavar="{verify}")
    verify = rsub.add_parser(
        "verify",
        help="verify every signature, who may sign, the layer tiling, the activation hash "
        "chains, the nonce binding and that the output is what the tail chose",
        description="Check a run receipt offline: its canonical encoding, every stage's and "
        "the coordinator's signature, that the stages' blocks tile all layers, that each "
        "stage's output chain equals the next one's input chain, that the output tokens are "
        "the tail's signed verdicts, that the nonce binds the job, and the output hash. "
        "Without --authority or --coordinator, anyone's keys can make a receipt that passes: "
        "the verdict then says which signers were NOT pinned.",
    )
    verify.add_argument("file", nargs="?", help="a receipt written by --receipt")
    verify.add_argument(
        "--evidence",
        metavar="FILE",
        help="check a failed audit's signed evidence instead (docs/security.md, spot checks): "
        "the seed commitment and the chunk it chose, the comparison redone, the accused's "
        "receipt and the auditor's signature",
    )
    verify.add_argument(
        "--auditor",
        metavar="PUB",
        help="with --evidence: the auditor's public key (64 hex digits or a .pub file)",
    )
    verify.add_argument(
        "--authority",
        metavar="PUB",
        help="the swarm authority's public key (64 hex digits or a .pub file): the coordinator "
        "and every stage must carry its admission token for the key they signed with",
    )
    verify.add_argument(
        "--coordinator",
        metavar="PUB",
        help="the coordinator's public key (64 hex digits or a .pub file): the key that must "
        "have signed the receipt (pins an insecure swarm's coordinator, which has no token)",
    )
    verify.add_argument(
        "--revoked",
        metavar="SERIALS",
        default="",
        help="with --authority: comma-separated token serials to refuse (the spec's revoked)",
    )

"""``shard manifest build|sign|verify``'s and ``shard fetch``'s arguments (run by
``shard.cli.weights``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, bounded


def add_weights(sub: argparse._SubParsersAction[Parser]) -> None:
    """``manifest`` and ``fetch``."""
    p = sub.add_parser(
        "manifest", help="build, sign and verify a model's signed manifest (docs/manifests.md)"
    )
    msub = p.add_subparsers(dest="manifest_command", required=True, metavar="{build,sign,verify}")
    build = msub.add_parser(
        "build",
        help="hash a checkpoint directory into a manifest (chunks, roots, tensor map)",
        description="Hash every file of MODEL_DIR in fixed-size chunks and write the manifest: "
        "header, chunk hashes, roots and the tensor map. MODEL_DIR may be 'smollm2' (bundled).",
    )
    build.add_argument("model_dir", help="checkpoint directory, or 'smollm2'")
    build.add_argument("--out", required=True, help="where to write the manifest (JSON)")
    build.add_argument("--id", help="model id (default: the bundled name or the directory name)")
    build.add_argument(
        "--version",
        type=bounded(int, 1, (1 << 63) - 1, "an integer >= 1"),
        default=1,
        help="manifest version; every new manifest of a model needs a higher one (default 1)",
    )
    build.add_argument(
        "--chunk-size",
        type=bounded(int, 1 << 10, 16 << 20, "a size in [1 KiB, 16 MiB] bytes"),
        default=1 << 20,
        help="chunk size in bytes (default 1 MiB)",
    )
    build.add_argument("--key", help="sign with this publisher key right away")
    build.add_argument("--force", action="store_true", help="replace OUT if it exists")
    sign = msub.add_parser("sign", help="sign a manifest with the publisher's key")
    sign.add_argument("manifest", help="manifest file")
    sign.add_argument("--key", required=True, help="the publisher's secret key (shard keygen)")
    sign.add_argument("--out", help="write the signed manifest here (default: in place)")
    verify = msub.add_parser(
        "verify",
        help="check a manifest's hashes and publisher signature (and a directory against it)",
    )
    verify.add_argument("manifest", help="manifest file")
    verify.add_argument("--publisher", required=True, help="publisher .pub file or 64 hex digits")
    verify.add_argument("--model", help="also check every chunk of this checkpoint directory")
    verify.add_argument("--previous", help="refuse unless newer than this accepted manifest")
    fetch = sub.add_parser(
        "fetch",
        help="fetch a stage's block now, verified chunk by chunk, showing progress",
        description="Fetch what stage NODE of SPEC needs (its [fetch] table: manifest, "
        "publisher, seeders) into the block cache, as `shard up --role stage` would at start.",
    )
    fetch.add_argument("--spec", required=True, help="swarm spec (TOML) with a [fetch] table")
    fetch.add_argument("--node", required=True, help="the stage whose block to fetch")

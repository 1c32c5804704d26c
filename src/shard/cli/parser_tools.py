"""The ``shard`` parser's subcommands for keys, receipts, manifests and the tools (``convert``,
``relay``, ``api-key``; ``draft`` in ``parser_draft``, ``bench`` in ``parser_bench``): the half
of ``shard.cli.parser`` that runs no node, and ``Parser``, the class of every parser in the
table. Split from it by size only; ``build_parser`` there adds both halves.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


class ParseExit(Exception):
    """A tool's parser finished parsing with this exit code (its help printed, or its one
    error line); ``shard.cli.main`` returns the code rather than exiting."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with two per-parser settings, both off by default.

    ``reports`` (e.g. ``"shard convert"``): a usage error is one line, ``shard convert: error:
    MESSAGE (see shard convert --help)``, exit 2, and ``--help`` returns 0, as the tools always
    did, instead of argparse's usage block and ``SystemExit``. ``strict``: arguments left over
    are this parser's error (``shard relay: error: unrecognized arguments``), not the top
    parser's. ``populate`` adds the arguments when this parser first parses, so a parser whose
    defaults live in a heavy module (``shard draft``: torch) costs ``shard --help`` nothing.
    """

    reports: str | None = None
    strict: bool = False
    populate: Callable[[Parser], None] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.populate is not None:
            populate, self.populate = self.populate, None
            populate(self)
        parsed, rest = super().parse_known_args(args, namespace)
        if rest and self.strict:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        return parsed, rest

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if self.reports is None:
            super().exit(status, message)
        if message:
            print(message, end="", file=sys.stderr)
        raise ParseExit(status)

    def error(self, message: str) -> NoReturn:
        if self.reports is None:
            super().error(message)
        print(f"{self.reports}: error: {message} (see {self.reports} --help)", file=sys.stderr)
        raise ParseExit(2)


def bounded(kind: type[int] | type[float], low: float, high: float, what: str) -> Any:
    """An argparse type accepting ``kind`` values in [low, high], with a message saying so."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse


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


def add_tools(sub: argparse._SubParsersAction[Parser]) -> None:
    """``convert``, ``relay``, ``draft`` and ``bench``."""
    from shard.cli.parser_bench import add_bench
    from shard.cli.parser_draft import add_draft

    _add_convert(sub)
    _add_relay(sub)
    add_draft(sub)
    add_bench(sub)


def _add_convert(sub: argparse._SubParsersAction[Parser]) -> None:
    conv = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint to a Hugging Face directory (safetensors)",
        description="Convert a Llama, Mistral, Mixtral, Gemma 3, Qwen3, Qwen3-MoE, gpt-oss or "
        "GLM-4.5-MoE GGUF checkpoint into a model "
        "directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json); "
        "quantized tensors stay quantized where an exact mapping exists (docs/model.md).",
    )
    conv.reports, conv.strict = "shard convert", True
    conv.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="the GGUF file to read")
    conv.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new directory")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.add_argument(
        "--float32",
        action="store_true",
        help="dequantize every tensor to float32 (a checkpoint transformers can load)",
    )


def _add_relay(sub: argparse._SubParsersAction[Parser]) -> None:
    relay = sub.add_parser(
        "relay",
        help="a delaying TCP relay that emulates a WAN link",
        description="Forward TCP from --listen to --target, adding one-way latency each way.",
    )
    relay.strict, relay.populate = True, _relay_args


def _relay_args(relay: Parser) -> None:
    """Added when ``shard relay`` parses: its defaults live in ``shard.transport``."""
    from shard.transport.relay import MAX_BUFFERED_BYTES, MAX_CONNECTIONS

    relay.add_argument("--listen", required=True, help="host:port to accept on (port 0: any)")
    relay.add_argument("--target", required=True, help="host:port to forward to")
    relay.add_argument("--latency-ms", type=float, required=True, help="one-way delay, ms")
    relay.add_argument(
        "--bandwidth-mbps", type=float, default=0.0, help="cap per direction, Mbit/s (0: none)"
    )
    relay.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help=f"connections relayed at once; more are closed at once (default {MAX_CONNECTIONS})",
    )
    relay.add_argument(
        "--max-buffer-mib",
        type=int,
        default=MAX_BUFFERED_BYTES >> 20,
        help="MiB held in flight by all connections together, shared out per direction; a "
        f"direction whose share is spent stops reading (default {MAX_BUFFERED_BYTES >> 20})",
    )


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


def add_manifest(sub: argparse._SubParsersAction[Parser]) -> None:
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

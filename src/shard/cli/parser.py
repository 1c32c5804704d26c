"""The ``shard`` command's argument parser.

Each subcommand's work lives in the module that owns it (``shard.cli.generate``, ``swarm``,
``keys``, ``weights``; ``model.gguf_import``, ``transport.relay``, ``bench``,
``decode.distill`` parse their own arguments); this module only builds the parser, so
``shard --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from shard import __version__

EPILOG = """\
examples:
  shard swarm run specs/local.toml --prompt "The capital of France is"
  shard swarm run specs/local.toml --prompts specs/prompts.txt --json
  echo "Hello" | shard generate --local - --ignore-eos --max-tokens 32
  shard generate --local "The capital of France is"
  shard swarm up specs/local.toml --api 8000  # OpenAI API + chat page: http://127.0.0.1:8000/
  shard swarm up specs/wan-sim.toml          # then, elsewhere:
  shard generate --spec specs/wan-sim.toml "Write a haiku about rivers" --chat
  shard up --role stage --spec specs/local.toml --node s1
  shard monitor --spec specs/local.toml       # watch a running swarm live
  shard convert model.gguf out_dir/
  shard bench specs/local.toml --latencies 0,25 --json out.json
  shard keygen --out keys/authority.key      # the swarm's authority
  shard keygen --out keys/s0.key
  shard api-key --keys api-keys.txt --label alice   # a bearer key for [api] keys_file
  shard admit --authority keys/authority.key --node-pub keys/s0.key.pub --swarm lab \\
      --roles stage --expires 30d --out keys/s0.token
"""


def _bounded(kind: type[int] | type[float], low: float, high: float, what: str) -> Any:
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


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=_bounded(int, 1, 1 << 30, "a positive integer"),
        default=64,
        help="tokens to generate (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=_bounded(float, 0.0, 100.0, "a temperature in [0, 100]"),
        default=0.0,
        help="0 = greedy (default; so is anything below 1e-4); >0 samples",
    )
    p.add_argument(
        "--top-p",
        type=_bounded(float, 1e-9, 1.0, "a probability mass in (0, 1]"),
        default=1.0,
        help="nucleus sampling mass (default 1)",
    )
    p.add_argument(
        "--top-k",
        type=_bounded(int, 0, 1 << 30, "a non-negative integer"),
        default=0,
        help="keep the k likeliest tokens (0 = all)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same output")
    p.add_argument(
        "--k",
        type=_bounded(int, 0, 64, "an integer in 0..64"),
        default=None,
        help="with a swarm: drafted tokens per verify chunk for this request (0 = plain "
        "decoding; default: the spec's [speculation] policy)",
    )
    p.add_argument(
        "--depth",
        type=_bounded(int, 1, 64, "an integer in 1..64"),
        default=None,
        help="with a swarm: verify chunks in flight for this request (default: the spec's)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _ignore_eos_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at end-of-sequence: generate exactly --max-tokens (benchmarks)",
    )


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text: on this machine (--local) or on a running swarm (--spec)",
        description="Generate a completion. --local runs the whole model in this process "
        "(the reference every distributed mode is compared with); --spec sends the prompt to "
        "the coordinator of a running swarm.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the whole model here")
    where.add_argument("--spec", help="swarm spec (TOML) of a running swarm")
    p.add_argument(
        "--model",
        help="with --local: 'smollm2' (bundled, default), a checkpoint dir or a .gguf file",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="KV length with --local (default: 2048, capped at the model's context length)",
    )
    p.add_argument(
        "--key", help="this client's secret key (secure swarms; else [trust] client_key)"
    )
    p.add_argument("--token", help="this client's admission token (secure swarms)")
    p.add_argument(
        "--receipt",
        metavar="OUT",
        help="with --spec: write the run's signed receipt (JSON) to OUT; check it with "
        "`shard receipt verify OUT`",
    )
    p.add_argument("prompt", help="the prompt text; - reads it from standard input")
    _sampling_args(p)
    _ignore_eos_arg(p)


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="run one node of a swarm (the form an operator runs on each machine)",
        description="Run one node of the swarm described by SPEC until interrupted. A stage "
        "loads its block, dials its successor and then serves its predecessor; the "
        "coordinator serves the tail's return link, control links and clients, and dials "
        "stage 0; a standby ([[standby]] in the spec) loads its block, registers with the "
        "coordinator and waits to replace a stage that dies (docs/failover.md).",
    )
    p.add_argument("--role", required=True, choices=["stage", "coordinator", "standby", "seeder"])
    p.add_argument("--spec", required=True, help="swarm spec (TOML)")
    p.add_argument("--node", help="node name in the spec (default: the coordinator's name)")
    p.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    p.add_argument(
        "--successor", help="dial this HOST:PORT downstream instead of the spec's (e.g. a relay)"
    )
    p.add_argument(
        "--device",
        help="cpu, cuda, cuda:N or auto: where this node computes (overrides the spec's device)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations (overrides the node's and the swarm's dtype in the spec)",
    )
    p.add_argument(
        "--graphs",
        choices=["off", "lazy", "warm"],
        help="CUDA graphs per chunk shape on a GPU stage: lazy (first use), warm (at session "
        "open) or off (overrides the spec's graphs; docs/model.md)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds (default 180)")
    p.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="with --role coordinator: serve the OpenAI-compatible HTTP API and the chat page "
        "at HOST:PORT (a bare PORT binds 127.0.0.1; default: the spec's [api] listen; "
        "docs/api.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for this node's forward pass (default: torch's choice; "
        "`swarm up/run` give each node its share of the cores)",
    )
    p.add_argument(
        "--die-with-parent",
        type=int,
        metavar="PID",
        default=None,
        help="exit as soon as process PID exits (the launcher of `swarm up/run` passes its own "
        "PID, so no node outlives it, even when it is SIGKILLed; Linux)",
    )


def _add_swarm(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("swarm", help="start a whole swarm from a spec as local processes")
    ssub = p.add_subparsers(dest="swarm_command", required=True, metavar="{up,run}")
    up = ssub.add_parser(
        "up",
        help="start every node of SPEC and keep them running until Ctrl-C",
        description="Start every node of SPEC as a local process (with delaying relays where "
        "the spec sets link latency) and keep them running until Ctrl-C, SIGTERM or SIGHUP, "
        "which stops them all (exit 128 + the signal). A stage or standby that dies is "
        "reported (SHARD NODE EXITED) and replaced by a standby; the swarm serves on "
        "(docs/failover.md). Only the coordinator's death ends it.",
    )
    up.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    up.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    up.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="the coordinator serves the OpenAI-compatible HTTP API and the chat page at "
        "HOST:PORT (a bare PORT binds 127.0.0.1; default: the spec's [api] listen; docs/api.md)",
    )
    up.add_argument(
        "--monitor",
        action="store_true",
        help="watch the swarm in the live monitor; quitting the monitor stops the swarm",
    )
    run = ssub.add_parser(
        "run",
        help="start SPEC, run prompt(s), print the output, tear everything down",
        description="Start every node of SPEC, run the prompt(s) through the ring, print the "
        "completions (or JSON with --json) and stop every process.",
    )
    run.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    what = run.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; - reads it from standard input")
    what.add_argument("--prompts", help="a UTF-8 file with one prompt per line")
    run.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    run.add_argument(
        "--receipt",
        metavar="OUT",
        help="write each run's signed receipt (JSON) to OUT (OUT.2.json, ... for more prompts)",
    )
    _sampling_args(run)
    _ignore_eos_arg(run)


def _add_trust(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "--roles", required=True, help="comma-separated: stage, coordinator, client, monitor"
    )
    admit.add_argument("--expires", default="30d", help="lifetime: 30d, 12h, 90m, 2w (default 30d)")
    admit.add_argument(
        "--serial",
        type=_bounded(int, 0, (1 << 63) - 1, "an integer >= 0"),
        help="token serial (default: random)",
    )
    admit.add_argument("--out", required=True, help="where to write the token")


def _add_monitor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "monitor",
        help="watch a running swarm live: ring latency, tok/s, α, stages, events",
        description="Open the live monitor on a coordinator's status feed: the ring with each "
        "edge's latency, tok/s and α sparklines, per-stage compute, the event log. Keys: q "
        "quits, p pauses, r resets the rolling statistics. Reconnects when the coordinator "
        "restarts.",
    )
    p.add_argument("address", nargs="?", help="the coordinator's HOST:PORT (with --swarm)")
    p.add_argument("--swarm", help="the swarm's name (the handshake checks it)")
    p.add_argument("--spec", help="swarm spec (TOML): its coordinator address and name")
    p.add_argument(
        "--key",
        help="with --spec of a secure swarm: this monitor's secret key (else [trust] client_key)",
    )
    p.add_argument(
        "--token",
        help="with --spec of a secure swarm: its token admitting role monitor (else [trust] "
        "client_token)",
    )


def _add_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conv = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint to a Hugging Face directory (safetensors)",
        add_help=False,
    )
    conv.add_argument("args", nargs=argparse.REMAINDER)
    relay = sub.add_parser(
        "relay", help="a delaying TCP relay that emulates a WAN link", add_help=False
    )
    relay.add_argument("args", nargs=argparse.REMAINDER)
    draft = sub.add_parser(
        "draft",
        help="distil a small draft model from a target (`shard draft distill`)",
        add_help=False,
    )
    draft.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser(
        "bench",
        help="benchmark plain vs speculative vs pipelined decoding through local rings",
        add_help=False,
    )
    bench.add_argument("args", nargs=argparse.REMAINDER)


def _add_receipt(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    verify.add_argument("file", help="a receipt written by --receipt")
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


def _add_manifest(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        type=_bounded(int, 1, (1 << 63) - 1, "an integer >= 1"),
        default=1,
        help="manifest version; every new manifest of a model needs a higher one (default 1)",
    )
    build.add_argument(
        "--chunk-size",
        type=_bounded(int, 1 << 10, 16 << 20, "a size in [1 KiB, 16 MiB] bytes"),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shard",
        description="Run one large language model across many machines as a ring of stages.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (to stderr)")
    parser.add_argument("--version", action="version", version=f"shard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_swarm(sub)
    _add_up(sub)
    _add_monitor(sub)
    _add_trust(sub)
    _add_receipt(sub)
    _add_manifest(sub)
    _add_tools(sub)
    return parser

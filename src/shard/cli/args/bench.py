"""``shard bench``'s arguments (run by ``shard.cli.bench``; also ``bench/speculation_ring.py``'s:
``bench_parser``), one ``add_argument`` per option in the order ``--help`` lists them. What they
mean and how they are checked is ``shard.cli.benchmark.options``."""

from __future__ import annotations

import argparse
from pathlib import Path

from shard.cli.args.base import Parser
from shard.cli.benchmark.options import DEFAULT_DRAFTS, DESCRIPTION, MODES


def add_bench(sub: argparse._SubParsersAction[Parser]) -> None:
    """The ``bench`` subcommand."""
    p = sub.add_parser(
        "bench",
        help="benchmark plain vs speculative vs pipelined decoding through local rings",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.strict = True
    _bench_args(p)


def bench_parser(prog: str) -> Parser:
    """The same arguments as a parser of their own, for ``bench/speculation_ring.py``."""
    p = Parser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _bench_args(p)
    return p


def _bench_args(p: argparse.ArgumentParser) -> None:
    """Paths default to None: ``shard.cli.benchmark.options`` resolves them against the
    repository."""
    p.add_argument(
        "spec",
        nargs="?",
        type=Path,
        default=None,
        help="base swarm spec (default specs/local.toml); its latency and draft are replaced",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="prompt-set file (default bench/prompts/spec_ring.toml)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="subset of plain,spec,pipelined")
    p.add_argument(
        "--drafts",
        default=",".join(DEFAULT_DRAFTS),
        help="subset of ngram,best,head,hybrid,hybrid_chain,mtp,mtp_coordinator,oracle "
        "(default ngram,best,oracle); hybrid_chain: the hybrid without branches; mtp: the "
        "checkpoint's MTP block at the tail, mtp_coordinator: the same block at the "
        "coordinator (a checkpoint that holds one)",
    )
    p.add_argument(
        "--head",
        help="the head, hybrid and hybrid_chain drafts' head: a directory or a head name (default "
        "<model>-head, which must be built: shard draft train), or an EAGLE-3 head: its "
        "directory or a shipped one's name (smollm2-eagle3)",
    )
    p.add_argument(
        "--latencies", default="0,10,25,50", help="one-way ms per ring edge (default 0,10,25,50)"
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--sets", default="", help="only these prompt sets, comma-separated")
    p.add_argument("--per-set", type=int, default=0, help="at most N prompts per set (0 = all)")
    p.add_argument(
        "--best-draft",
        default="auto",
        help="the 'best' draft: auto (the candidate with the highest predicted rate: truncated "
        "--best-layers and distilled drafts in the cache), layers:N, or a checkpoint dir",
    )
    p.add_argument(
        "--best-layers", default="2,4,6,8", help="truncated-draft candidates (default 2,4,6,8)"
    )
    p.add_argument("--model", help="checkpoint dir to use instead of the spec's model")
    p.add_argument(
        "--json",
        type=Path,
        help="output (default: a new bench/results/spec_ring-<UTC time>.json)",
    )
    p.add_argument("--plot", help="PNG of tok/s against latency (default: --json's .png; none)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request (and reference) runs exactly --max-tokens: EOS does not stop it",
    )
    p.add_argument("--force", action="store_true", help="replace --json / --plot files that exist")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in this process for references and draft timing (default 1: what "
        "each ring node gets on 2 cores; 0 = torch's default)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument(
        "--oracle-policy",
        choices=["fixed", "spec"],
        default="fixed",
        help="oracle K and depth: fixed at k_max / depth_max (default) or the spec's policy",
    )

"""Handlers of ``shard manifest build|sign|verify``, ``shard fetch`` and ``shard up --role
seeder`` (parsing lives in ``cli``; dispatch and error printing in ``commands``).

Each returns an exit code and prints one machine-readable line on success; failures are
``ManifestError`` / ``FetchError`` / ``IdentityError`` that ``commands`` prints as one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

from shard.trust.identity import NodeIdentity, read_public_key
from shard.weights.manifest import (
    Manifest,
    ManifestMismatch,
    check_hashes,
    check_newer,
    check_structure,
    verify,
)

__all__ = ["check_directory", "fetch_main", "manifest_main", "seeder_main"]


def manifest_main(args: argparse.Namespace) -> int:
    """``shard manifest build|sign|verify``."""
    if args.manifest_command == "build":
        return _build(args)
    if args.manifest_command == "sign":
        return _sign(args)
    return _verify(args)


def _build(args: argparse.Namespace) -> int:
    from shard.convert.bundled import BUNDLED, resolve_model
    from shard.weights.build import build_manifest

    model_dir = resolve_model(args.model_dir)
    model_id = args.id or (args.model_dir if args.model_dir in BUNDLED else model_dir.name)
    manifest = build_manifest(
        model_dir, model=model_id, version=args.version, chunk_size=args.chunk_size
    )
    if args.key is not None:
        manifest = manifest.signed(NodeIdentity.load(Path(args.key)))
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"shard: error: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1
    manifest.save(out)
    print(f"manifest={out} {manifest.describe()}")
    return 0


def _sign(args: argparse.Namespace) -> int:
    manifest = Manifest.from_file(Path(args.manifest))
    check_structure(manifest)
    check_hashes(manifest)  # never put a signature on a manifest that does not add up
    signed = manifest.signed(NodeIdentity.load(Path(args.key)))
    out = Path(args.out or args.manifest)
    signed.save(out)
    print(f"manifest={out} {signed.describe()}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    manifest = Manifest.from_file(Path(args.manifest))
    verify(manifest, read_public_key(args.publisher))
    if args.previous is not None:
        check_newer(Manifest.from_file(Path(args.previous)), manifest)
    if args.model is not None:
        from shard.convert.bundled import resolve_model

        problems = check_directory(manifest, resolve_model(args.model))
        if problems:
            raise ManifestMismatch(f"{args.model}: " + "; ".join(problems[:5]))
    print(f"ok manifest={args.manifest} {manifest.describe()}")
    return 0


def check_directory(manifest: Manifest, directory: Path) -> list[str]:
    """What in ``directory`` differs from ``manifest``: missing files, sizes, chunk hashes."""
    from shard.weights.build import hash_file

    problems = []
    for f in manifest.files:
        path = directory / f.path
        if not path.is_file():
            problems.append(f"{f.path} is missing")
            continue
        have = hash_file(path, f.path, manifest.chunk_size)
        if have.size != f.size:
            problems.append(f"{f.path} is {have.size} bytes, the manifest says {f.size}")
            continue
        bad = [i for i, (a, b) in enumerate(zip(have.chunks, f.chunks, strict=True)) if a != b]
        if bad:
            problems.append(f"{f.path}: chunks {bad[:5]} do not match")
    return problems


def fetch_main(args: argparse.Namespace) -> int:
    """``shard fetch --spec SPEC --node STAGE``: fetch a stage's block now, with progress."""
    from shard.nodes.fetching import fetch_stage
    from shard.spec.swarm import load_spec
    from shard.weights.fetch import FetchProgress

    spec = load_spec(args.spec)
    if spec.fetch is None or args.node not in {s.name for s in spec.stages}:
        print(
            f"shard: error: {args.spec} has no [fetch] table or no stage {args.node!r}",
            file=sys.stderr,
        )
        return 2

    shown = [-1]

    def show(p: FetchProgress) -> None:
        percent = 100 * p.bytes_done // max(p.bytes_total, 1)
        if percent != shown[0]:  # one update per percent, not per chunk
            shown[0] = percent
            line = f"fetch {args.node}: {p.chunks_done}/{p.chunks_total} chunks {percent}%"
            print(f"\r{line}", end="", file=sys.stderr, flush=True)

    report = trio.run(lambda: fetch_stage(spec, args.node, progress=show))
    print(file=sys.stderr)
    bad = ",".join(report.bad_peers) or "-"
    print(
        f"fetched path={report.path} chunks={report.chunks_total} new={report.chunks_fetched} "
        f"reused={report.chunks_reused} bytes={report.bytes_fetched} bad_peers={bad}"
    )
    return 0


def seeder_main(args: argparse.Namespace) -> int:
    """``shard up --role seeder --spec SPEC --node NAME [--model DIR]``: serve until Ctrl-C."""
    from shard.convert.bundled import resolve_model
    from shard.nodes.launcher import ready_line
    from shard.nodes.seeder import run_seeder
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    names = [s.name for s in spec.fetch.seeders] if spec.fetch is not None else []
    if args.node not in names or args.node in {s.name for s in spec.stages}:
        print(
            f"shard: error: no seeder {args.node!r} in {args.spec} (seeders: "
            f"{', '.join(n for n in names if n not in {s.name for s in spec.stages}) or 'none'}; "
            "a stage named as a seeder serves from its own `shard up --role stage`)",
            file=sys.stderr,
        )
        return 2
    model_dir = Path(args.model) if args.model else resolve_model(spec.model)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(run_seeder, spec, args.node, model_dir)
            print(ready_line(args.node, address), flush=True)

    trio.run(serve)
    return 0

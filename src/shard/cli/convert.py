"""``shard convert MODEL.gguf OUT_DIR``: convert a GGUF checkpoint (``shard.convert.gguf_import``),
print where it wrote; 0, or 2 with one ``shard convert: error:`` line. The arguments are
declared in ``shard.cli.args.convert``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shard.convert.gguf_arch import ConvertError
from shard.convert.gguf_import import convert_gguf

__all__ = ["convert", "convert_main"]


def convert(args: argparse.Namespace) -> int:
    """Convert ``args.gguf`` into ``args.out_dir``; 0, or 2 with one line on a bad input."""
    try:
        out = convert_gguf(
            args.gguf, args.out_dir, progress=not args.no_progress, stored=not args.float32
        )
    except ConvertError as exc:
        print(f"shard convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def convert_main(argv: Sequence[str]) -> int:
    """``shard convert ARGV``, parsed by the command table: what ``shard convert`` returns."""
    from shard.cli import main

    return main(["convert", *argv])

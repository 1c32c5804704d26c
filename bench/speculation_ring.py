"""Speculative decoding through the ring, side by side: plain vs speculative (D = 1) vs
speculative + pipelined, with the n-gram draft, the best model draft and the oracle ceiling,
at several emulated latencies per edge. The same driver as ``shard bench``
(``shard.cli.benchmark``); this script only supplies the repository's defaults.

    .venv/bin/python bench/speculation_ring.py --help
    .venv/bin/python bench/speculation_ring.py          # the full default run, ~20 min on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

from shard.cli.bench import bench_main

if __name__ == "__main__":
    sys.exit(
        bench_main(
            sys.argv[1:],
            root=Path(__file__).resolve().parent.parent,
            prog="bench/speculation_ring.py",
        )
    )

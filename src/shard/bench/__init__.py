"""The speculative ring benchmark: ``shard bench`` and ``bench/spec_ring.py`` (the same driver).

On one machine, side by side in one run: plain decoding, speculative decoding (one verify
chunk in flight, D = 1) and speculative + pipelined decoding, each with the n-gram draft, the
best model draft and the oracle draft (a labelled ceiling: it replays the single-process
reference, so α = 1), through rings of stage processes at several emulated latencies per
edge; every run next to its analytical bound. Benchmarks are not tests: nothing asserts speed.

    options.py   command line and the prompt-set file
    ringspec.py  one ring's spec, derived from the base spec (latency, draft, free ports)
    drafts.py    single-process references, the oracle file, choosing the best model draft
    bound.py     the analytical bound of one run (pure)
    rings.py     the rings and the interleaved requests
    report.py    medians, ratios, the Markdown table and the PNG plot
    main.py      ``bench_main``: the run, start to JSON
"""

from shard.bench.main import bench_main

__all__ = ["bench_main"]

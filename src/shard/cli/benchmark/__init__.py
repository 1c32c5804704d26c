"""The speculative ring benchmark: ``shard bench`` and ``bench/speculation_ring.py`` (the same
driver).

On one machine, side by side in one run: plain decoding, speculative decoding (one verify
chunk in flight, D = 1) and speculative + pipelined decoding, each with the n-gram draft, the
best model draft and the oracle draft (a labelled ceiling: it replays the single-process
reference, so α = 1), through rings of stage processes at several emulated latencies per
edge; every run next to its analytical bound. Benchmarks are not tests: nothing asserts speed.

    options.py   the options (checked; ``shard.cli.args.bench`` declares the flags) and
                 the prompt-set file
    ringspec.py  one ring's spec, derived from the base spec (latency, draft, free ports)
    drafts.py    single-process references, the oracle file, choosing the best model draft
    bound.py     the analytical bound of one run (pure)
    rings.py     the rings and the interleaved requests
    sweep.py     per latency, one ring per draft, every prompt through every mode, interleaved
    geolap.py    a placement plan's lap, measured on local processes behind its latencies
    report.py    medians, ratios, the Markdown table and the PNG plot
    main.py      ``run_bench``: the run, start to JSON

The command, ``shard bench`` (and ``bench_main`` for ``bench/speculation_ring.py``), is
``shard.cli.bench``.
"""

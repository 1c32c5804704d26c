"""shard.cli.args: every ``shard`` command's arguments, one module per command module of
``shard.cli`` (``shard.cli.parser`` assembles them into the one parser)::

    base.py      ``Parser`` (the class of every parser in the table), ``ParseExit``, the
                 argparse types ``bounded`` and ``within``, the sampling flags ``generate``
                 and ``swarm run`` share; it imports none of the modules below
    generate.py  ``generate``
    up.py        ``up`` (``--join`` among its flags)
    swarm.py     ``swarm up|run``, ``monitor``
    plan.py      ``plan`` (the planner, and the fit before a download)
    keys.py      ``keygen``, ``api-key``, ``admit``, ``receipt verify``
    ledger.py    ``ledger``
    weights.py   ``manifest build|sign|verify``, ``fetch``
    convert.py   ``convert``
    relay.py     ``relay`` (its flags added when it parses)
    draft.py     ``draft distill|train|path`` (added when it parses)
    bench.py     ``bench`` (and ``bench_parser``, the same flags for ``bench/speculation_ring.py``)

Each imports only ``base.py`` of this package: no module here imports another command's.
"""

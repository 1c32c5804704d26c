"""``python -m shard`` is the ``shard`` command."""

from shard.cli import main

raise SystemExit(main())

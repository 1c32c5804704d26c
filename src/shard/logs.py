"""Log levels every package shares: ``NOTE``, what an operator sees without ``--verbose``.

Python's levels leave a gap between INFO (shown with ``--verbose``) and WARNING (something
went wrong): a swarm's good news — the ring formed, a dead stage replaced, a node back in
its slot — was logged at WARNING so that it showed at all, and read like a failure. ``NOTE``
(25) sits between them: ``shard``'s CLI shows it by default (``shard.cli.dispatch``) and
prints it as ``NOTE``. This module imports nothing of shard, so every layer may use it.
"""

from __future__ import annotations

import logging

__all__ = ["NOTE"]

#: Good news an operator should see by default (between INFO and WARNING).
NOTE = 25
logging.addLevelName(NOTE, "NOTE")

"""Keep the garbage collector's full passes short on a node that is serving.

A node's heap after start-up is mostly objects that live as long as the process: torch's and
the other imports' module state, the tokenizer, the model's parameters and their wrappers
(about 210,000 objects on a SmolLM2 stage). CPython's full (generation 2) collection walks all
of them, and it runs whenever the long-lived objects have grown by a quarter — on a loaded host
that took 0.5-0.9 s with the event loop stopped, so a stage's heartbeats paused long enough for
the failure detector to suspect it (``tests/test_failover_hogs.py``: 0.67 s collections in the
tail stage at its first request, beside ten CPU hogs).

``settle`` moves every object alive at that moment into the collector's permanent generation
(``gc.freeze``): later passes walk only what was made since. ``shard up`` calls it once, when
its node is ready. It first collects the young generations only (milliseconds: recent cycles
of garbage, such as a loader's temporaries, are freed, not frozen); a full collection there
would be the very pause this avoids, and the few cycles already old are kept. A block loaded
later (a standby's ``Activate``) adds thousands of objects, not hundreds of thousands, so it is
not settled: the library never freezes its caller's heap (an in-process test's, say).
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect the young generations, then ``gc.freeze`` every object alive; returns how many
    the collector keeps frozen."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["settle"]

"""``shard.compute.collector.settle``: what is alive when a node is ready is out of the garbage
collector's full passes (the pause it avoids is shown by ``tests/test_failover_hogs.py``)."""

from __future__ import annotations

import gc
import sys

from shard.compute.collector import settle


class _Lasting:
    pass


def test_settle_freezes_what_is_alive_and_leaves_later_objects_collectable() -> None:
    lasting = [_Lasting() for _ in range(1000)]
    # Another thread left by an earlier test (an idle worker letting go of its locals) can
    # free frozen objects between settle's count and ours (574,110 then 574,108 in one full
    # run): with no thread switch until the count is read, the two are the same moment's.
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(60.0)
        try:
            frozen = settle()
            count = gc.get_freeze_count()
        finally:
            sys.setswitchinterval(interval)
        assert frozen >= len(lasting)
        assert count == frozen
        tracked = {id(o) for o in gc.get_objects(generation=2)}
        assert not tracked & {id(o) for o in lasting}  # a full pass no longer walks them
        later = _Lasting()
        later.self = later  # a cycle made after settling is still garbage to the collector
        del later
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

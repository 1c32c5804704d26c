"""Moved to ``shard.compute.offload``; this name stays only while this wave's work lands."""

from shard.compute.offload import inline_compute as inline_compute
from shard.compute.offload import run_sync as run_sync

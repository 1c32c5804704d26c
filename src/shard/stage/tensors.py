"""Moved to ``shard.compute.tensors``; this name stays only while this wave's work lands."""

from shard.compute.tensors import from_wire as from_wire
from shard.compute.tensors import to_wire as to_wire

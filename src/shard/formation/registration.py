"""A joining node's registration to a forming swarm, checked for shape before it is taken.

``check_register`` says why a ``Register`` is refused (a ``Fault`` of kind ``register`` from
the scheduler, and that connection closed), or None: it must carry a measured ``NodeProfile``
and a listen address with its bound port, and every claim in the profile must be within the
bounds below. The node's word is checked for shape only, never believed more: the formation
(``shard.formation``) measures the mesh itself and plans with what it measured.
"""

from __future__ import annotations

import math

from shard.messages import Register
from shard.spec.nodes import Address

#: Bounds a registration must keep (a node's claims, checked for shape, never believed more).
_MAX_MEMORY = 1 << 50
_MAX_MS = 1e6
_MAX_LABEL = 200


def check_register(reg: Register) -> str | None:
    """Why a registration to a forming swarm is refused, or None when it is well formed."""
    p = reg.profile
    if p is None:
        return (
            "this swarm forms its ring from nodes started with --join; a node needs a "
            "measured profile (start it with shard up --role stage --join HOST:PORT)"
        )
    try:
        address = Address.parse(reg.address)
    except ValueError as exc:
        return f"listen address {reg.address[:80]!r}: {exc}"
    if address.port == 0:
        return f"listen address {reg.address!r} has port 0; register the bound port"
    if not 0 <= p.memory_bytes <= _MAX_MEMORY:
        return f"memory {p.memory_bytes} bytes is outside 0..{_MAX_MEMORY}"
    for what, ms in (("1-token", p.ms_per_layer_one), ("chunk", p.ms_per_layer_chunk)):
        if not (math.isfinite(ms) and 0 < ms <= _MAX_MS):
            return f"{what} ms per layer {ms!r} is not a number in (0, {_MAX_MS:g}]"
    if not 1 <= p.chunk_tokens <= 4096:
        return f"chunk of {p.chunk_tokens} tokens is outside 1..4096"
    if len(p.device) > _MAX_LABEL:
        return f"device label longer than {_MAX_LABEL} characters"
    return None


__all__ = ["check_register"]

"""Reachability in a swarm spec: which nodes accept inbound connections, and the relay.

A node with ``reachable = false`` (default true) accepts no inbound connection (it sits
behind NAT). Every other node reaches it at ``nat:NAME`` (``advertised``): a node that does
accept inbound connections has it dial back, and two that do not meet at the relay,
``[swarm] relay`` — a node's name, the coordinator by default (``shard.transport.nat``).

Rules (``check_reach``): the relay must accept inbound connections, and so must the
coordinator (control links, clients, the tail's return link and the callee links all dial
it; a coordinator behind NAT is not supported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from shard.spec.validate import SpecError, Table

#: The prefix of the address of a node that accepts no inbound connection.
NAT_PREFIX: Final = "nat:"


class Reachable(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def reachable(self) -> bool: ...


def read_reachable(table: Table) -> bool:
    """A node's ``reachable`` (default true)."""
    return table.boolean("reachable", default=True)


def read_relay(swarm: Table, coordinator: str) -> str:
    """``[swarm] relay``: the name of the node holding the relay role (default: the
    coordinator's); checked against the nodes by ``check_reach``."""
    return swarm.string("relay", default=coordinator, example='"coord"')


def check_reach(
    source: str, relay: str, coordinator: Reachable, nodes: Sequence[Reachable]
) -> None:
    """The relay exists and accepts inbound connections; so does the coordinator."""
    if not coordinator.reachable:
        raise SpecError(
            source,
            "coordinator.reachable",
            "the coordinator must accept inbound connections (stages, clients and the relay's "
            "callees dial it); run it where a port can be opened, and put the stages behind NAT",
        )
    by_name = {node.name: node for node in (coordinator, *nodes)}
    holder = by_name.get(relay)
    if holder is None:
        raise SpecError(
            source, "swarm.relay", f"no node named {relay!r}; name the coordinator or a stage"
        )
    if not holder.reachable:
        raise SpecError(
            source,
            "swarm.relay",
            f"{relay} has reachable = false, but nodes behind NAT dial the relay; choose a node "
            "that accepts inbound connections (the coordinator by default)",
        )


def advertised(node: Reachable, listen: str) -> str:
    """The address others dial to reach ``node``: its listen address, or ``nat:NAME``."""
    return listen if node.reachable else f"{NAT_PREFIX}{node.name}"

"""A control client whose node is played by plain functions, for tests that drive the
scheduler with scripted nodes: it wires the node's ``Duties`` (``shard.failover.duties``)
to those functions in its own nursery, as a node's root does, and runs the client there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

from shard.failover.control import ControlClient, ControlLink
from shard.failover.duties import Order, duties
from shard.failover.fence import Fence
from shard.messages import Hello, MeasureRtt, NodeName, Register, RttReport
from shard.transport import Network
from shard.transport.links import HANDSHAKE_TIMEOUT_S


async def no_orders(order: Order) -> None:
    return None


@attrs.frozen
class AnsweredClient:
    """``ControlClient`` of node ``node`` dialling ``address``; its orders run ``obey`` and
    its measurements ``measure`` (None: it measures nothing)."""

    node: NodeName
    network: Network
    address: str | tuple[str, ...]
    register: Callable[[], Register]
    swarm: str
    role: str = "stage"
    obey: Callable[[Order], Awaitable[None]] = no_orders
    measure: Callable[[MeasureRtt], Awaitable[RttReport]] | None = None
    heartbeat_s: float = 0.25
    dead_after_s: float = 1.0
    connect_timeout_s: float = 10.0
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    name_wait_s: float | None = None
    fence: Fence | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """``ControlClient.run``, its errors raised as themselves."""
        addresses = (self.address,) if isinstance(self.address, str) else self.address
        link = ControlLink(
            self.node,
            addresses,
            Hello(node=self.node, role=self.role, swarm=self.swarm, link="control"),
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
            connect_timeout_s=self.connect_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            name_wait_s=self.name_wait_s,
        )
        ended: Exception | None = None
        async with trio.open_nursery() as nursery:
            asked = duties(nursery, self.obey, measure=self.measure)
            client = ControlClient(link, self.network, self.register, asked, fence=self.fence)
            try:
                await client.run(task_status=task_status)
            except Exception as exc:  # raised below, outside the nursery: not in a group
                ended = exc
            nursery.cancel_scope.cancel()
        if ended is not None:
            raise ended

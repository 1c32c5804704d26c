"""Deterministic fault injection: a seeded ``FaultPlan`` applied by a ``FaultyNetwork``.

Public API for tests of the failure path (used by ``tests/test_failover.py``)::

    plan = FaultPlan.random(seed, kind="kill", node="s1", frames=(14, 40))
    faults = FaultInjector(plan)
    await nursery.start(partial(run_swarm, spec, ..., wrap=faults.wrap, scopes=faults.scopes))

Each node's network is wrapped; the wrapper counts the data frames a node sends on its ring
edge (heartbeats, control links and clients are not counted, so the count is the same on
every run) and, at the planned frame, injects the fault:

=========  ============================================================================
drop       the frame is lost
delay      the edge holds the frame (and, FIFO, everything behind it) for ``seconds``
duplicate  the frame arrives twice
reorder    the frame arrives after the next one
corrupt    the frame fails its integrity check at the receiver, which resets the
           connection: modelled as the frame lost and the connection closed (on the real
           wire the sealed channel's AEAD tag is what catches it; docs/security.md)
sever      the connection closes before the frame is sent
stall      the node freezes (nothing in or out, heartbeats included) for ``seconds``
kill       the node dies: its cancel scope is cancelled and its connections close
=========  ============================================================================

Run the swarm under ``trio.testing.MockClock(autojump_threshold=0)`` and inside
``shard.compute.offload.inline_compute()``: seconds of heartbeats and timeouts pass in milliseconds,
and the same seed gives the same plan.
"""

from __future__ import annotations

import random
from typing import Final

import attrs
import trio

from shard.messages import Heartbeat, Hello, Message
from shard.transport import Connection, ConnectionClosed, Network
from shard.transport.base import Handler, NetworkBase

LINK_FAULTS: Final = ("drop", "delay", "duplicate", "reorder", "corrupt", "sever")
NODE_FAULTS: Final = ("stall", "kill")
FAULT_KINDS: Final = (*LINK_FAULTS, *NODE_FAULTS)


@attrs.frozen
class Injection:
    """One fault: ``kind`` at the ``at``-th data frame ``node`` sends on its ring edge."""

    kind: str
    node: str
    at: int
    seconds: float = 0.0

    def __str__(self) -> str:
        extra = f" for {self.seconds:g} s" if self.seconds else ""
        return f"{self.kind} {self.node}@{self.at}{extra}"


@attrs.frozen
class FaultPlan:
    """A seed and the injections it produced; ``str`` of a plan is enough to replay it."""

    seed: int
    injections: tuple[Injection, ...]

    def __str__(self) -> str:
        return f"seed={self.seed}: " + ", ".join(str(i) for i in self.injections)

    @classmethod
    def random(
        cls,
        seed: int,
        *,
        kind: str,
        node: str,
        frames: tuple[int, int],
        seconds: tuple[float, float] = (0.5, 3.0),
    ) -> FaultPlan:
        """One injection of ``kind`` at ``node``, at a frame drawn from ``frames`` (inclusive)
        and, for delay and stall, a duration drawn from ``seconds``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(FAULT_KINDS)}")
        rng = random.Random(seed)
        at = rng.randint(*frames)
        length = round(rng.uniform(*seconds), 3) if kind in ("delay", "stall") else 0.0
        return cls(seed, (Injection(kind, node, at, length),))


class _NodeState:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sent = 0
        self.stalled_until = 0.0
        self.conns: set[Connection] = set()

    async def wait_if_stalled(self) -> None:
        if trio.current_time() < self.stalled_until:
            await trio.sleep_until(self.stalled_until)


class FaultInjector:
    """Holds the plan, each node's state and cancel scope; ``wrap`` is ``run_swarm``'s hook.

    ``fired`` lists the injections that happened, in order (a scenario whose frame was never
    reached fired nothing: tests assert on it).
    """

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.scopes: dict[str, trio.CancelScope] = {}
        self.fired: list[Injection] = []
        self._nodes: dict[str, _NodeState] = {}
        self._fired_event = trio.Event()

    async def wait_fired(self) -> None:
        """Return once an injection has fired (a test starts its next step from there)."""
        await self._fired_event.wait()

    def _fire(self, injection: Injection) -> None:
        self.fired.append(injection)
        self._fired_event.set()

    def wrap(self, node: str, network: Network) -> Network:
        state = self._nodes.setdefault(node, _NodeState(node))
        return FaultyNetwork(network, state, self)

    def _due(self, state: _NodeState) -> Injection | None:
        for injection in self.plan.injections:
            if injection.node == state.name and injection.at == state.sent:
                return injection
        return None

    def stall(self, node: str, seconds: float) -> None:
        """Freeze ``node`` now for ``seconds`` (``math.inf``: for good, a machine that is
        gone): nothing in or out on its wrapped connections, which stay open — only the
        failure detector can tell. A fault by time, not by frame (simulated churn)."""
        state = self._nodes.setdefault(node, _NodeState(node))
        state.stalled_until = trio.current_time() + seconds

    def kill(self, node: str) -> None:
        scope = self.scopes.get(node)
        if scope is not None:
            scope.cancel()


class FaultyNetwork(NetworkBase):
    """One node's view of the network with the plan's faults (see the module docstring)."""

    def __init__(self, inner: Network, state: _NodeState, injector: FaultInjector) -> None:
        self._inner = inner
        self._state = state
        self._injector = injector

    async def dial(self, address: str) -> Connection:
        conn = await self._inner.dial(address)
        return FaultyConnection(conn, self._state, self._injector)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        state, injector = self._state, self._injector

        async def wrapped(conn: Connection) -> None:
            await handler(FaultyConnection(conn, state, injector, counts=False))

        await self._inner.serve(address, wrapped, task_status=task_status)


class FaultyConnection:
    """A connection that applies the plan to the frames its node sends on a ring edge."""

    def __init__(
        self,
        inner: Connection,
        state: _NodeState,
        injector: FaultInjector,
        *,
        counts: bool = True,
    ) -> None:
        self._inner = inner
        self._state = state
        self._injector = injector
        self._counts = counts
        self._ring = False
        self._held: Message | None = None
        state.conns.add(self)

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def receive(self) -> Message:
        msg = await self._inner.receive()
        await self._state.wait_if_stalled()
        return msg

    async def aclose(self) -> None:
        self._state.conns.discard(self)
        await self._inner.aclose()

    async def send(self, msg: Message) -> None:
        await self._state.wait_if_stalled()
        if isinstance(msg, Hello):
            self._ring = (
                self._counts and msg.link == "ring" and msg.role in ("stage", "coordinator")
            )
            await self._inner.send(msg)
            return
        if not self._ring or isinstance(msg, Heartbeat):
            await self._inner.send(msg)
            return
        self._state.sent += 1
        injection = self._injector._due(self._state)
        if injection is None:
            await self._inner.send(msg)
            await self._release_held()
            return
        self._injector._fire(injection)
        kind = injection.kind
        if kind == "drop":
            return
        if kind == "delay":
            await trio.sleep(injection.seconds)
            await self._inner.send(msg)
        elif kind == "duplicate":
            await self._inner.send(msg)
            await self._inner.send(msg)
        elif kind == "reorder":
            self._held = msg  # goes out after the next frame
        elif kind == "corrupt":  # sent, but the receiver rejects it and resets the link
            await self._inner.aclose()
        elif kind == "sever":  # the link breaks under the sender, which still holds the frame
            await self._inner.aclose()
            raise ConnectionClosed(f"{self.peer}: connection severed (injected)")
        elif kind == "stall":
            self._state.stalled_until = trio.current_time() + injection.seconds
            await self._state.wait_if_stalled()
            await self._inner.send(msg)
        elif kind == "kill":
            self._injector.kill(self._state.name)
            await self._inner.aclose()
            raise ConnectionClosed(f"{self.peer}: {self._state.name} was killed")

    async def _release_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            await self._inner.send(held)


__all__ = [
    "FAULT_KINDS",
    "LINK_FAULTS",
    "NODE_FAULTS",
    "FaultInjector",
    "FaultPlan",
    "FaultyConnection",
    "FaultyNetwork",
    "Injection",
]

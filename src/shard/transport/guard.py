"""Connection guard: a connection's failure is that connection's alone.

Every listening point runs each accepted connection through ``serve_one`` (the networks call
it for every handler; a node's roots call it again per link kind, so the log names the link).
A hostile or broken peer can make a frame fail to decode or open (``WireError``, the sealer's
errors included), break or stall its link (``TransportError``, ``PeerTooSlow``), fail a
handshake (``HandshakeError``) or break its link's protocol (``ProtocolViolation``). Each of
those ends the one connection it arrived on: logged once, the connection closed with a
reason, the node serving on. Handlers may raise them from inside their own nurseries: an
exception group made only of connection errors is one connection error. Anything else is a
bug and propagates.

``receive_within`` / ``send_within`` / ``IdleDeadline`` are the deadlines a link applies to
its peer (``[limits] idle_timeout_s`` and ``message_timeout_s``): a peer that stops reading, or
that keeps a connection open without using it, is cut instead of holding the node's memory
and tasks. ``Activity`` is what "idle" means for any served connection: no whole message in
either direction (heartbeats count) and no work running for the peer — or, on a link whose use
is work (a client's: ``IdleDeadline``), no work since the last ended, whatever messages came
(heartbeats do not count there). ``PeerDeadlines`` are
the deadlines a listening network applies to every connection it serves, whatever its link
(``shard.transport.websocket``): idle, a message trickled too slowly, and which connection
makes room when one host's connections fill its cap.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from shard.errors import HandshakeError
from shard.messages import Fault, Message, NodeName
from shard.transport.base import Connection, ConnectionClosed, Handler, TransportError
from shard.transport.budget import BudgetedStream
from shard.transport.paths import Pipe
from shard.wire import WireError

log = logging.getLogger("shard.transport")

#: How long a connection being cut gets to take the reason (a peer that stops reading never
#: will; the close does not wait for it).
REASON_GRACE_S = 0.5


class PeerTooSlow(TransportError):
    """The peer missed a deadline: it sent nothing useful for too long, or did not take a
    message in time. The message names the deadline and the ``[limits]`` key behind it."""


class ProtocolViolation(Exception):
    """The peer sent a well-formed message that breaks its link's protocol (unsolicited,
    out of order, or one its role may not send). Ends only that connection."""


#: What ends one connection and never a node.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    WireError,
    TransportError,
    HandshakeError,
    ProtocolViolation,
)


def connection_failure(exc: BaseException) -> Exception | None:
    """The connection error ``exc`` stands for, or None when it is (or holds) anything else.

    A handler's nursery wraps its tasks' errors in an exception group: the group is a
    connection failure when every exception in it is one (the most telling is returned: not an
    ordinary close if there is another). A bug or a cancellation beside them is not.
    """
    if isinstance(exc, CONNECTION_ERRORS):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    matched, rest = exc.split(CONNECTION_ERRORS)
    if rest is not None or matched is None:
        return None
    leaves = list(_leaves(matched))
    return next((e for e in leaves if not isinstance(e, ConnectionClosed)), leaves[0])


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[Exception]:
    out: list[Exception] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        elif isinstance(exc, Exception):
            out.append(exc)
    return out


async def serve_one(
    conn: Connection, handler: Handler, *, what: str = "connection", node: NodeName | None = None
) -> None:
    """Run ``handler(conn)``, then close ``conn``; a connection error ends only ``conn``.

    ``what`` names the link in the log (``"client link"``). With ``node``, a peer cut for a
    deadline or a protocol violation is first told why (a ``Fault`` from ``node``, within
    ``REASON_GRACE_S``); a malformed frame was already answered by the transport (WebSocket
    close 1008 with the reason).

    Errors: connection errors (``CONNECTION_ERRORS``, also inside exception groups) are logged
    once — an ordinary close at info, the rest at warning, naming the peer — and not raised;
    anything else propagates.
    """
    try:
        await handler(conn)
    except BaseException as exc:
        failure = connection_failure(exc)
        if failure is None:
            raise
        await _cut(conn, failure, what=what, node=node)
    finally:
        with trio.CancelScope(shield=True):
            await conn.aclose()


async def serve_pipe(pipe: Pipe, handler: Callable[[Pipe], Awaitable[None]]) -> None:
    """``serve_one`` for a raw pipe (``shard.transport.paths``): run ``handler(pipe)``, then
    close it; a connection error ends only this pipe (logged), anything else propagates."""
    try:
        await handler(pipe)
    except BaseException as exc:
        failure = connection_failure(exc)
        if failure is None:
            raise
        level = logging.INFO if isinstance(failure, ConnectionClosed) else logging.WARNING
        log.log(level, "pipe from %s ended: %s: %s", pipe.peer, type(failure).__name__, failure)
    finally:
        with trio.CancelScope(shield=True):
            await pipe.aclose()


async def _cut(conn: Connection, failure: Exception, *, what: str, node: NodeName | None) -> None:
    if isinstance(failure, ConnectionClosed):
        log.info("%s from %s closed: %s", what, conn.peer, failure)
        return
    log.warning("%s from %s ended: %s: %s", what, conn.peer, type(failure).__name__, failure)
    if node is None or not isinstance(failure, PeerTooSlow | ProtocolViolation):
        return
    kind = "timeout" if isinstance(failure, PeerTooSlow) else "protocol"
    with trio.move_on_after(REASON_GRACE_S):
        try:
            await conn.send(Fault(node=node, kind=kind, detail=str(failure)[:500]))
        except (TransportError, WireError):
            pass  # it is being cut anyway; the log has the reason


async def receive_within(conn: Connection, timeout_s: float, *, what: str) -> Message:
    """``conn.receive()``, bounded by ``timeout_s``.

    Errors: ``PeerTooSlow`` when no whole message arrived in time (a silent peer, or one
    trickling a frame); otherwise as ``conn.receive``.
    """
    with trio.move_on_after(timeout_s):
        return await conn.receive()
    raise PeerTooSlow(f"{what} {conn.peer}: no message within {timeout_s:g} s")


async def send_within(conn: Connection, msg: Message, timeout_s: float, *, what: str) -> None:
    """``conn.send(msg)``, bounded by ``timeout_s`` (then the connection must be closed: a
    cut send may leave a partial frame).

    Errors: ``PeerTooSlow`` when the peer did not take it in time (it stopped reading);
    otherwise as ``conn.send``.
    """
    with trio.move_on_after(timeout_s):
        await conn.send(msg)
        return
    raise PeerTooSlow(
        f"{what} {conn.peer} did not take a {type(msg).__name__} within {timeout_s:g} s "
        "(limits.message_timeout_s): it stopped reading"
    )


#: The slowest a message in progress may arrive once ``PeerDeadlines.message_s`` has passed:
#: each 64 KiB received of it buys one more second (an honest large frame on a slow link
#: finishes; a trickle of a few bytes a second does not).
MESSAGE_FLOOR_BYTES_PER_S = 64 * 1024


@attrs.frozen
class PeerDeadlines:
    """What a listening network holds every served connection to, whatever its link (the
    link's own deadlines, with their reasons, come first; these are the floor).

    ``idle_s``: no whole message either way and no work running for the peer (``Activity``)
    this long, and the connection is cut. ``message_s``: a message whose first byte arrived
    must end within this, plus a second per ``MESSAGE_FLOOR_BYTES_PER_S`` received of it.
    ``reclaim_idle_s``: when one host's connections fill its cap, the one idle longest, if
    idle at least this long, is closed to make room for the new one (else it is refused).
    """

    idle_s: float = 330.0
    message_s: float = 30.0
    reclaim_idle_s: float = 10.0


class Activity:
    """When a connection last carried a whole message in either direction, and how much
    work its link runs for the peer now (a client's requests: ``IdleDeadline`` says). A
    connection is idle while no work runs, counted from its last message or the end of its
    last work, whichever came later.

    A link whose use is work (a client link: its requests) says so with ``by_work()``: from
    then on messages no longer count (``touch`` is ignored), only work does, counted from the
    end of the last work or from ``by_work()``. So a client that only sends heartbeats is idle
    to the network (reclaimable under its host's cap, cut at ``idle_s``) however often it
    sends them; links whose use is messages (ring, return, control, monitor) keep counting
    them.
    """

    def __init__(self) -> None:
        self.last = trio.current_time()
        self.busy = 0
        self._by_work = False

    def touch(self) -> None:
        """A whole message went either way (ignored after ``by_work()``)."""
        if not self._by_work:
            self.last = trio.current_time()

    def by_work(self) -> None:
        """Count only work from now on (see the class docstring); idle from now."""
        self._by_work = True
        self.last = trio.current_time()

    def worked(self) -> None:
        """A piece of work for the peer ended now."""
        self.last = trio.current_time()

    def idle_for(self, now: float) -> float:
        return 0.0 if self.busy else max(0.0, now - self.last)


def activity_of(conn: object) -> Activity | None:
    """The ``Activity`` of ``conn`` (a WebSocket connection, sealed or not), or None."""
    found = getattr(conn, "activity", None)
    return found if isinstance(found, Activity) else None


async def police(
    stream: BudgetedStream,
    activity: Activity,
    deadlines: PeerDeadlines,
    cut: trio.CancelScope,
    peer: str,
) -> None:
    """Cancel ``cut`` (logged) once a served connection is idle for ``deadlines.idle_s`` or
    trickles a message (see ``PeerDeadlines``); woken by each message's first byte on
    ``stream``, never polling."""
    while True:
        now = trio.current_time()
        idle_at = now - activity.idle_for(now) + deadlines.idle_s
        since = stream.message_since
        due = math.inf
        if since is not None and not stream.behind:  # behind: this node is not reading
            due = since + deadlines.message_s + stream.message_bytes / MESSAGE_FLOOR_BYTES_PER_S
            if now >= due:
                why = (
                    f"a message took over {now - since:.0f} s to arrive "
                    f"({stream.message_bytes} bytes so far; limits.message_timeout_s): a trickle"
                )
                break
        if now >= idle_at:
            why = f"no message either way for {deadlines.idle_s:g} s (limits.idle_timeout_s)"
            break
        with trio.move_on_at(min(idle_at, due)):
            await stream.wait_message_start()
    log.warning("cut %s: %s", peer, why)
    cut.cancel()


class IdleDeadline:
    """A cancel scope (``scope``) that fires ``idle_s`` after the last piece of work ended.

    Work is bracketed by ``begin()`` / ``end()``; while any runs, the deadline is off. A link
    runs its receive loop in ``scope``: a peer that keeps a connection open without asking for
    anything is cut, however it trickles bytes or messages that start no work (heartbeats
    included). With ``conn``, its ``Activity`` counts work only (``Activity.by_work``): busy
    while work runs, so the network never counts it idle then, and idle from the end of the
    last work however many messages the peer sends meanwhile — so when its host is at
    ``max_peer_connections`` a heartbeating client that runs nothing is reclaimed for a
    newcomer like a silent one.
    """

    def __init__(self, idle_s: float, conn: object = None) -> None:
        self.idle_s = idle_s
        self.scope = trio.CancelScope(deadline=trio.current_time() + idle_s)
        self._running = 0
        self._activity = activity_of(conn)
        if self._activity is not None:
            self._activity.by_work()

    def begin(self) -> None:
        self._running += 1
        self.scope.deadline = math.inf
        if self._activity is not None:
            self._activity.busy += 1

    def end(self) -> None:
        self._running -= 1
        if self._activity is not None:
            self._activity.busy -= 1
            self._activity.worked()
        if self._running == 0:
            self.scope.deadline = trio.current_time() + self.idle_s

    @property
    def fired(self) -> bool:
        return self.scope.cancelled_caught


__all__ = [
    "CONNECTION_ERRORS",
    "MESSAGE_FLOOR_BYTES_PER_S",
    "Activity",
    "IdleDeadline",
    "PeerDeadlines",
    "PeerTooSlow",
    "ProtocolViolation",
    "activity_of",
    "connection_failure",
    "police",
    "receive_within",
    "send_within",
    "serve_one",
    "serve_pipe",
]

"""A client of a running swarm: send a ``GenerateRequest`` to the coordinator, stream the
committed tokens back, return the ``GenerateDone``."""

from __future__ import annotations

from collections.abc import Callable

from shard.messages import GenerateDone, GenerateRequest, Hello, NodeName, TokensOut
from shard.transport import Network
from shard.transport.links import HANDSHAKE_TIMEOUT_S, dial_peer


class ClientError(Exception):
    """The coordinator could not be reached or answered something unexpected."""


async def request(
    network: Network,
    address: str,
    req: GenerateRequest,
    *,
    swarm: str,
    on_text: Callable[[TokensOut], None] | None = None,
    connect_timeout_s: float = 10.0,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> GenerateDone:
    """Run one request on the swarm whose coordinator listens at ``address``."""
    hello = Hello(node=NodeName("client"), role="client", swarm=swarm)
    conn = await dial_peer(
        network,
        address,
        hello,
        timeout_s=connect_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
    )
    try:
        await conn.send(req)
        while True:
            msg = await conn.receive()
            if isinstance(msg, TokensOut) and msg.request == req.request:
                if on_text is not None:
                    on_text(msg)
            elif isinstance(msg, GenerateDone) and msg.request == req.request:
                return msg
            else:
                raise ClientError(f"unexpected {type(msg).__name__} from {address}")
    finally:
        await conn.aclose()

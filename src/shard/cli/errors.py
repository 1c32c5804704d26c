"""Which errors an operator can hit, and how the command reports them.

Every handler returns an exit code. Errors an operator can hit (a bad spec, a missing model,
an unreachable node, a failed request) are printed as one ``shard: error: ...`` line with exit
code 1 (2 for usage errors); anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio


def operator_errors() -> tuple[type[BaseException], ...]:
    from shard.coordinator.client import ClientError
    from shard.coordinator.router import RingError
    from shard.decode.state import BadRequest
    from shard.failover.control import NodeReplaced
    from shard.model.bundled import ModelNotFound
    from shard.model.device import DeviceUnavailable
    from shard.model.loader import ModelLoadError
    from shard.nodes.launcher import SwarmError
    from shard.spec.swarm import SpecError
    from shard.transport import TransportError
    from shard.transport.links import HandshakeError
    from shard.trust.identity import IdentityError
    from shard.weights.fetch import FetchError
    from shard.weights.manifest import ManifestError

    return (
        SpecError,
        ModelLoadError,
        ModelNotFound,
        DeviceUnavailable,
        SwarmError,
        TransportError,
        HandshakeError,  # also every refusal of the secure wire (shard.trust.admission, channel)
        IdentityError,
        RingError,
        ClientError,
        BadRequest,
        ManifestError,
        FetchError,
        NodeReplaced,
        trio.TooSlowError,
    )


def leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc

"""Which errors an operator can hit, and how the command reports them.

Every handler returns an exit code. Errors an operator can hit (a bad spec, a missing model,
an unreachable node, a port already in use, input that is not UTF-8, a failed request) are
printed as one ``shard: error: ...`` line with exit code 1; options that do not go together
(``UsageError``) as one ``shard COMMAND: error: ...`` line with exit code 2, as argparse
reports a bad flag. Anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio


class UsageError(Exception):
    """Options that do not go together, or one that does not apply here: exit code 2."""


class InputError(Exception):
    """Input the command cannot use (a prompts file that cannot be read, text that is not
    UTF-8): one line naming it, exit code 1."""


def operator_errors() -> tuple[type[BaseException], ...]:
    from shard.api.keys import KeyFileError
    from shard.coordinator.client import ClientError
    from shard.coordinator.router import RingError
    from shard.decode.head.model import HeadError
    from shard.decode.state import BadRequest
    from shard.failover.control import JoinRefused, NodeReplaced
    from shard.failover.formation import FormationError
    from shard.model.bundled import ModelNotFound
    from shard.model.device import DeviceUnavailable
    from shard.model.gguf_import import ConvertError
    from shard.model.loader import ModelLoadError
    from shard.nodes.launcher import SwarmError
    from shard.placement import PlanError
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
        ConvertError,  # a bad .gguf given to --model / --local
        InputError,
        DeviceUnavailable,
        SwarmError,
        TransportError,  # includes ListenError: a port already in use
        HandshakeError,  # also every refusal of the secure wire (shard.trust.admission, channel)
        IdentityError,
        RingError,
        ClientError,
        BadRequest,
        ManifestError,
        FetchError,
        NodeReplaced,
        JoinRefused,  # a --join node whose registration the scheduler refused
        FormationError,  # a [formation] swarm whose nodes never came, or cannot hold the model
        KeyFileError,
        PlanError,  # shard plan: no ring fits, or a bad --rtt geography (GeographyError)
        HeadError,  # draft = "head": a draft_head that is no finished head (HeadNotFound)
        trio.TooSlowError,
    )


def leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc

"""Which errors an operator can hit, and how the command reports them.

Every handler returns an exit code. Errors an operator can hit (a bad spec, a missing model,
an unreachable node, a port already in use, input that is not UTF-8, a failed request) are
printed as one ``shard: error: ...`` line with exit code 1; options that do not go together
(``UsageError``) as one ``shard COMMAND: error: ...`` line with exit code 2, as argparse
reports a bad flag. Anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Final

import trio


class UsageError(Exception):
    """Options that do not go together, or one that does not apply here: exit code 2."""


class InputError(Exception):
    """Input the command cannot use (a prompts file that cannot be read, text that is not
    UTF-8): one line naming it, exit code 1."""


#: The errors an operator can hit, by the module that defines each and its class name. Only
#: the modules already imported are looked in: a class is imported before it can be raised, so
#: a module not in ``sys.modules`` has raised nothing. Importing them all to report one error
#: cost a client whose coordinator died ~10 s (torch), 18 s on a loaded host, before its line.
_OPERATOR_ERRORS: Final = (
    ("shard.spec.validate", "SpecError"),
    ("shard.model.config_fields", "ModelLoadError"),
    ("shard.convert.bundled", "ModelNotFound"),
    ("shard.convert.gguf_scan", "ConvertError"),  # a bad .gguf given to --model / --local
    ("shard.model.safetensors_header", "SafetensorsError"),  # a hostile header or index
    ("shard.model.footprint", "FootprintError"),  # plan: a checkpoint it cannot price
    ("shard.model.tokenizer", "TokenizerError"),  # --local --chat: a chat template that fails
    ("shard.cli.errors", "InputError"),
    ("shard.model.device", "DeviceUnavailable"),
    ("shard.nodes.launcher", "SwarmError"),
    ("shard.transport.base", "TransportError"),  # includes ListenError: a port already in use
    # also every refusal of the secure wire (shard.trust.admission, channel):
    ("shard.errors", "HandshakeError"),
    ("shard.trust.identity", "IdentityError"),
    ("shard.coordinator.events", "RingError"),
    ("shard.coordinator.client", "ClientError"),
    ("shard.decode.state", "BadRequest"),
    ("shard.weights.schema", "ManifestError"),
    ("shard.weights.fetch", "FetchError"),
    ("shard.failover.control", "NodeReplaced"),
    ("shard.failover.control", "JoinRefused"),  # a --join node whose registration was refused
    # a [formation] swarm whose nodes never came, or cannot hold the model:
    ("shard.formation.report", "FormationError"),
    ("shard.api.keys", "KeyFileError"),
    ("shard.placement.problem", "PlanError"),  # shard plan: no ring fits, or a bad --rtt geography
    ("shard.decode.head.model", "HeadError"),  # draft = "head": no finished head (HeadNotFound)
    ("shard.decode.head.eagle3_files", "Eagle3Error"),  # draft = "eagle3": a head that won't do
    ("shard.decode.head.mtp", "MtpError"),  # draft = "mtp": a checkpoint without its MTP block
)


def operator_errors() -> tuple[type[BaseException], ...]:
    """The error classes reported in one line (``_OPERATOR_ERRORS`` among the imported
    modules, and ``trio.TooSlowError``); importing nothing, so reporting is immediate."""
    found: list[type[BaseException]] = [trio.TooSlowError]
    for module, name in _OPERATOR_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None:
            found.append(getattr(loaded, name))
    return tuple(found)


def leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc

"""Ids, protocol constants and the dtypes a tensor payload may carry."""

from __future__ import annotations

from typing import NewType

SessionId = NewType("SessionId", int)
Epoch = NewType("Epoch", int)
ChunkSeq = NewType("ChunkSeq", int)
NodeName = NewType("NodeName", str)

PROTOCOL_VERSION = 1
#: Hello -> Welcome must finish within this many seconds unless a caller says otherwise: the
#: default of ``limits.handshake_timeout_s`` and of every link's handshake (the one definition).
HANDSHAKE_TIMEOUT_S = 10.0
#: A session id is ``incarnation << SESSION_BITS | n``: each coordinator start draws a new
#: incarnation, so stages recognise (and free) sessions a coordinator that died left behind.
SESSION_BITS = 32


def incarnation_of(session: int) -> int:
    """The coordinator start a session id belongs to (its high bits)."""
    return session >> SESSION_BITS


#: The most rows of target features a session may ask for with each verdict
#: (``OpenSession.features``).
MAX_FEATURES = 256
#: The most target layers whose entering states a session may ask for
#: (``OpenSession.feature_layers``; an EAGLE-3 head reads three).
MAX_FEATURE_LAYERS = 8
#: The most ids a tail's MTP block drafts after one verdict (``OpenSession.drafts``).
MAX_TAIL_DRAFTS = 32

#: dtypes a ``Tensor`` payload may carry, with their item size in bytes.
TENSOR_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,  # raw bytes: manifest chunks (ChunkData)
}
#: dtypes a swarm may run its model in (weights and activations), by ``TENSOR_DTYPES`` name.
#: The one list: the spec validates against it, the stage maps it onto torch by name.
RUN_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

"""Resuming a streamed completion on a standby coordinator (docs/api.md, "Resuming a stream").

A streamed reply from a coordinator that keeps checkpoints (one with a standby coordinator,
or ``[failover] checkpoint_dir``) names its request's resume key in the ``X-Shard-Resume-Key``
response header, and every chunk that carries text says how many output tokens the text so
far covers (``"shard": {"tokens": N}``). When the stream breaks before ``[DONE]`` (the
coordinator died), the client sends the same request to the standby's API with
``X-Shard-Resume: KEY:N`` and gets only the rest: the text after those ``N`` tokens.

This module is the header's edge: parsing and validating it, and making keys. A key is a
capability (who has it gets the request's output), so it is 128 random bits.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

import attrs

from shard.api.errors import ApiError

#: The request header of a resumed stream, and the response header naming the key
REQUEST_HEADER: Final = b"x-shard-resume"
KEY_HEADER: Final = "x-shard-resume-key"
#: What a key may be: a checkpoint's name (``shard.coordinator.checkpoint``), bounded
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: The most tokens a client can say it has (a count past the request's own is refused too)
_MAX_HAVE: Final = 1 << 24


@attrs.frozen
class Resume:
    """A re-issued stream: the request's key, and the output tokens the client has."""

    key: str
    have: int


def new_key() -> str:
    """A fresh resume key: 128 random bits, in the characters a key may use."""
    return secrets.token_hex(16)


def parse_resume(value: str, *, stream: bool, max_tokens: int) -> Resume | None:
    """The ``X-Shard-Resume: KEY:N`` header's value (``""``: not given, None).

    Errors: ``ApiError`` 400 (``invalid_resume``) for a malformed value, a count past
    ``max_tokens``, or a request that is not streamed."""
    if not value:
        return None
    key, sep, count = value.strip().rpartition(":")
    if not sep or not _KEY.fullmatch(key) or not count.isascii() or not count.isdigit():
        raise _invalid(
            "X-Shard-Resume must be KEY:N — the key from the X-Shard-Resume-Key header "
            "(letters, digits, '_', '.', '-'; at most 128) and the count of output tokens "
            'received (the last chunk\'s "shard": {"tokens": N})'
        )
    have = int(count) if len(count) <= 9 else _MAX_HAVE + 1  # no huge ints from a peer
    if have > min(max_tokens, _MAX_HAVE):
        raise _invalid(
            f"X-Shard-Resume says {count[:12]} tokens were received; the request asks for at "
            f"most {max_tokens}"
        )
    if not stream:
        raise _invalid('X-Shard-Resume resumes a streamed request: send it with "stream": true')
    return Resume(key, have)


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, param="X-Shard-Resume", code="invalid_resume")


__all__ = ["KEY_HEADER", "REQUEST_HEADER", "Resume", "new_key", "parse_resume"]

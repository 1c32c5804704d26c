"""A standby coordinator's follow link: the primary streams each running request's committed
tokens to it (``FollowCommit``) and says when a request ended (``FollowEnd``), so the standby
can take a request over where the primary stopped (docs/failover.md, "Standby coordinator").
"""

from __future__ import annotations

import attrs

from shard.messages.values import Sampling


@attrs.frozen
class FollowCommit:
    """Primary -> standby: request ``request``'s output from position ``offset`` on.

    ``offset == 0`` opens the request: the prompt, ``max_tokens``, sampling, the job id its
    receipt runs under and ``ignore_eos`` come with it; later ones carry only new output.
    ``generation`` is the primary's (the standby takes over with the next one)."""

    request: str
    offset: int
    output_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int = 0
    sampling: Sampling = Sampling()
    job: str = ""
    generation: int = 0
    ignore_eos: bool = False


@attrs.frozen
class FollowEnd:
    """Primary -> standby: request ``request`` ended (completed or failed for good)."""

    request: str

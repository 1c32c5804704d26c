"""Value types carried inside messages: raw tensor payloads, sampling parameters and a
draft's distribution at one drafted position."""

from __future__ import annotations

import attrs

from shard.messages.ids import TENSOR_DTYPES


@attrs.frozen
class Tensor:
    """A raw tensor payload: dtype name, shape and the row-major bytes.

    The wire sends ``data`` after the header, unencoded; ``shard.compute.tensors`` converts to and
    from ``torch.Tensor`` without copying more than once.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")

    @property
    def nbytes(self) -> int:
        n = TENSOR_DTYPES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


@attrs.frozen
class Sampling:
    """How the tail turns logits into a token. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@attrs.frozen
class DraftQ:
    """The draft's distribution q at one drafted position, when it sampled the token from it:
    the tokens it could have drawn (``ids``) and their probabilities (``probs``, summing to 1).

    With q the tail accepts the drafted token d with probability min(1, p(d)/q(d)) and else
    draws from the normalised residual max(0, p - q) (``shard.decode.verify``); without it
    (a greedy draft: q one-hot) it draws t ~ p and accepts iff t == d.
    """

    ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()

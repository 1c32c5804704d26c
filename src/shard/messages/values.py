"""Value types carried inside messages: raw tensor payloads and sampling parameters."""

from __future__ import annotations

import attrs

from shard.messages.ids import TENSOR_DTYPES


@attrs.frozen
class Tensor:
    """A raw tensor payload: dtype name, shape and the row-major bytes.

    The wire sends ``data`` after the header, unencoded; ``shard.stage.tensors`` converts to and
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

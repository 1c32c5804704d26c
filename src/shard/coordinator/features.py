"""The coordinator's side of features on the return path: a verdict's features, checked
before a proposer sees them (``shard.stage.features`` says which rows a tail sends).

The features come from the tail, a peer: their dtype, shape, values and positions are checked
here, and anything wrong is a ``FeatureError``. The driver ends that one request with a
``RingError`` carrying the tokens committed before the bad verdict (which is not folded in);
the coordinator and its other sessions go on.
"""

from __future__ import annotations

import torch

from shard.compute.tensors import from_wire
from shard.messages import Verdict

__all__ = ["FEATURE_DTYPES", "FeatureError", "verdict_features"]

#: The dtypes features may travel in (``shard.stage.features.wire_dtype``).
FEATURE_DTYPES = ("float16", "bfloat16")


class FeatureError(Exception):
    """A verdict's features are malformed, or came unasked."""


def verdict_features(
    verdict: Verdict, *, window: int, dim: int | None, prompt_len: int | None = None
) -> tuple[int, torch.Tensor] | None:
    """A verdict's checked features: (stream position of the first row, float32 ``[rows,
    dim]`` on the CPU), or None for a session that asked for none (``window`` 0).

    ``prompt_len`` marks the prompt's final verdict: its rows end at the prompt's last
    position, at least one and at most ``min(window, prompt_len)``. A verify verdict's rows
    are exactly the last ``min(window, len(target_ids))`` of its committed inputs. ``dim``
    is the target's hidden size (None: any width). ``FeatureError`` for anything else.
    """
    wire = verdict.features
    if window == 0:
        if wire is not None:
            raise FeatureError("the tail sent features this session did not ask for")
        return None
    if wire is None:
        raise FeatureError(f"no features in a verdict of a session that asked for {window}")
    if wire.dtype not in FEATURE_DTYPES:
        raise FeatureError(f"features are {wire.dtype}, not one of {', '.join(FEATURE_DTYPES)}")
    if len(wire.shape) != 2 or wire.shape[1] < 1 or (dim is not None and wire.shape[1] != dim):
        width = "hidden" if dim is None else str(dim)
        raise FeatureError(f"features of shape {wire.shape}, not [rows, {width}]")
    rows = wire.shape[0]
    if prompt_len is None:
        end, most = verdict.start + len(verdict.target_ids), len(verdict.target_ids)
        fits = rows == min(window, most)
    else:
        end, most = prompt_len, prompt_len
        fits = 1 <= rows <= min(window, most)
    if not fits:
        raise FeatureError(
            f"{rows} rows of features where the window is {window} and the verdict holds {most}"
        )
    if verdict.features_start + rows != end:
        raise FeatureError(
            f"features at positions [{verdict.features_start}, {verdict.features_start + rows}) "
            f"do not end at {end}, the verdict's last committed input + 1"
        )
    try:
        features = from_wire(wire).float()  # [rows, dim]
    except ValueError as exc:
        raise FeatureError(f"bad features payload: {exc}") from None
    if not bool(torch.isfinite(features).all()):
        raise FeatureError("features hold NaN or infinity")
    return verdict.features_start, features

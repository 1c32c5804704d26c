"""Where a node computes: the ``device``, ``dtype`` and ``graphs`` keys of a node table.

```toml
[swarm]
dtype = "bfloat16"     # the swarm's dtype: weights and activations (default "float32")
weights = "stored"     # how weights are held (default: dense in dtype); docs/specs.md

[[stage]]
name = "s0"
device = "cuda:0"      # "cpu" (the default), "cuda", "cuda:N" or "auto" (cuda if there is one)
dtype = "bfloat16"     # optional: overrides [swarm] dtype for this node
weights = "int8"       # optional: overrides [swarm] weights for this node
graphs = "lazy"        # CUDA graphs per chunk shape: "off" (the default), "lazy", "warm"
```

Only the syntax is checked here: a spec is plain data and imports no torch, and whether
``cuda:1`` exists is a fact about the machine a node starts on, not about the file. The node
checks that when it starts (``shard.model.device.resolve_device``) and refuses with one line.

Activations cross every edge of the ring in one dtype, so stages and standbys must agree on
theirs (``check_dtypes``); the coordinator's own (its draft model's) may differ.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from shard.messages import RUN_DTYPES
from shard.spec.validate import SpecError, Table

#: Activation / weight dtypes a swarm may run in.
#: Activation / weight dtypes a swarm may run in (defined once, in ``shard.messages``).
DTYPES: Final = RUN_DTYPES
#: Capture modes for CUDA graphs (``shard.stage.graphs``).
GRAPH_MODES: Final = ("off", "lazy", "warm")
#: How a node holds its weights (``shard.model.weights``, which a test keeps in step).
WEIGHTS: Final = ("stored", "float32", "bfloat16", "float16", "int8", "int4")
DEVICE_KEYS: Final = ("device", "dtype", "weights")
STAGE_DEVICE_KEYS: Final = (*DEVICE_KEYS, "graphs")

_DEVICE = re.compile(r"cpu|auto|cuda(?::(0|[1-9][0-9]{0,2}))?")
_DEVICE_HINT: Final = 'use "cpu", "cuda", "cuda:N" or "auto"'


@attrs.frozen
class DeviceSpec:
    """One node's device (``cpu``, ``cuda``, ``cuda:N``, ``auto``), dtype (None: the swarm's)
    and CUDA-graph mode (stages and standbys; ``off`` on the coordinator)."""

    device: str = "cpu"
    dtype: str | None = None
    graphs: str = "off"
    weights: str | None = None  # None: the swarm's (and where that is None, dense in dtype)


def check_device(text: str) -> str:
    """``text`` if it spells a device; ``ValueError`` saying what is allowed otherwise."""
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"unknown device {text!r}; {_DEVICE_HINT}")
    return text


def check_dtype(text: str) -> str:
    """``text`` if it is one of ``DTYPES``; ``ValueError`` otherwise."""
    if text not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return text


def check_weights(text: str) -> str:
    """``text`` if it is one of ``WEIGHTS``; ``ValueError`` otherwise."""
    if text not in WEIGHTS:
        raise ValueError(f"unknown weights {text!r}; use one of {', '.join(WEIGHTS)}")
    return text


def check_weights_dtype(weights: str | None, dtype: str) -> str | None:
    """Why ``weights`` contradicts ``dtype`` (one line), or None: dense weights compute in
    their own dtype, so a float ``weights`` must equal ``dtype``."""
    if weights is None or weights in ("stored", "int8", "int4") or weights == dtype:
        return None
    return (
        f"weights = {weights!r} contradicts dtype = {dtype!r}: dense weights compute in their "
        f'own dtype; set both to {weights!r}, or weights = "stored", "int8" or "int4"'
    )


def check_graphs(text: str) -> str:
    """``text`` if it is one of ``GRAPH_MODES``; ``ValueError`` otherwise."""
    if text not in GRAPH_MODES:
        raise ValueError(f"unknown graphs mode {text!r}; use one of {', '.join(GRAPH_MODES)}")
    return text


def read_device(table: Table, *, graphs: bool) -> DeviceSpec:
    """Validate a node table's ``device``, ``dtype`` and (when ``graphs``) ``graphs`` keys."""
    dtype = None
    if "dtype" in table.data:
        dtype = _checked(table, "dtype", check_dtype, '"bfloat16"')
    weights = None
    if "weights" in table.data:
        weights = _checked(table, "weights", check_weights, '"stored"')
    mode = "off"
    if graphs:
        mode = _checked(table, "graphs", check_graphs, '"lazy"', default="off")
    return DeviceSpec(
        device=_checked(table, "device", check_device, '"cuda:0"', default="cpu"),
        dtype=dtype,
        graphs=mode,
        weights=weights,
    )


def _checked(
    table: Table, key: str, check: Callable[[str], str], example: str, default: str | None = None
) -> str:
    text = table.string(key, default=default, example=example)
    try:
        return check(text)
    except ValueError as e:
        raise table.error(key, f"{e}; e.g. {key} = {example}") from None


def check_dtypes(source: str, swarm_dtype: str, nodes: Sequence[tuple[str, DeviceSpec]]) -> None:
    """Every stage and standby (``nodes``: their ``(key, DeviceSpec)``) runs in one dtype."""
    first: tuple[str, str] | None = None
    for key, runtime in nodes:
        dtype = runtime.dtype or swarm_dtype
        if first is None:
            first = (key, dtype)
        elif dtype != first[1]:
            raise SpecError(
                source,
                f"{key}.dtype",
                f"{dtype} but {first[0]} runs in {first[1]}; activations cross the ring in one "
                "dtype, so every stage and standby needs the same (set it in [swarm] dtype)",
            )

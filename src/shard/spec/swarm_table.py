"""The ``[swarm]`` table's own keys, read and checked: the model (a bundled name or a path),
the dtype, how nodes hold weights (``weights``) and ``insecure``. ``SwarmSpec.from_dict``
(``shard.spec.swarm``) calls these; ``name`` and ``relay`` have their readers with the nodes
(``shard.spec.nodes``, ``shard.spec.reach``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from shard.spec.device import DTYPES, DeviceSpec, check_weights, check_weights_dtype
from shard.spec.validate import SpecError, Table

#: Model names that need no path: shipped with shard (``shard.model`` knows where).
BUNDLED_MODELS: Final = ("smollm2", "gemma3-270m")


def read_model(swarm: Table, base_dir: Path | None) -> str:
    model = swarm.string("model", example='"smollm2"')
    if model in BUNDLED_MODELS:
        return model
    path = Path(model).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    path = path.resolve()
    use = f"use one of {', '.join(BUNDLED_MODELS)} or a HF checkpoint directory or a .gguf file"
    if not path.exists():
        relative = "" if base_dir is None else " (relative paths resolve against the spec's dir)"
        raise swarm.error("model", f"{str(path)!r} not found{relative}; {use}")
    if path.is_file() and path.suffix != ".gguf":
        raise swarm.error("model", f"{str(path)!r} is a file but not a .gguf; {use}")
    return str(path)


def read_weights(swarm: Table) -> str | None:
    if "weights" not in swarm.data:
        return None
    text = swarm.string("weights", example='"stored"')
    try:
        return check_weights(text)
    except ValueError as e:
        raise swarm.error("weights", str(e)) from None


def check_nodes_weights(
    source: str, dtype: str, weights: str | None, nodes: list[tuple[str, DeviceSpec]]
) -> None:
    """Each node's ``weights`` (its own, else the swarm's) agrees with its dtype; a clash is
    reported at the key that made it: the node's own ``weights`` or ``dtype``, else
    ``swarm.weights`` (both inherited from ``[swarm]``)."""
    for key, runtime in nodes:
        why = check_weights_dtype(runtime.weights or weights, runtime.dtype or dtype)
        if why is not None:
            where = (
                f"{key}.weights" if runtime.weights is not None
                else f"{key}.dtype" if runtime.dtype is not None
                else "swarm.weights"
            )  # fmt: skip
            raise SpecError(source, where, why)


def read_dtype(swarm: Table) -> str:
    dtype = swarm.string("dtype", default="float32")
    if dtype not in DTYPES:
        raise swarm.error("dtype", f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype  # a node may override it: shard.spec.device


def read_insecure(swarm: Table) -> bool:
    # false (the default) needs [trust] and node credentials: spec_trust.check_secure
    return swarm.boolean("insecure", default=False)

"""The ``[speculation]`` table of a swarm spec: which draft, how many tokens, how deep.

```toml
[speculation]
draft = "auto"          # none | ngram | model | auto (n-gram and model, chosen per round)
draft_layers = 6        # model draft = the target's first N layers + its head, or
draft_model = "path"    # a separate checkpoint sharing the target's tokenizer
# draft = "oracle" with oracle_file = "refs.json": replays prior reference runs (benchmarks only)
k = "auto"              # drafted tokens per chunk: "auto" (adaptive) or 0..k_max (0 = plain)
depth = "auto"          # verify chunks in flight per session: "auto" or 1..depth_max
k_max = 8
depth_max = 4
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from shard.decode.control import SpecConfig
from shard.spec.validate import Table

DRAFT_KINDS: Final = ("none", "ngram", "model", "auto", "oracle")
SPECULATION_KEYS: Final = (
    "draft",
    "draft_model",
    "draft_layers",
    "k",
    "depth",
    "k_max",
    "depth_max",
    "oracle_file",
)


@attrs.frozen
class SpeculationSpec:
    """Typed ``[speculation]``: which draft (``draft``, ``draft_model``, ``draft_layers``,
    ``oracle_file``) and how much to speculate (``policy``: ``k``, ``depth``, ``k_max``,
    ``depth_max``). Default: no drafting.

    ``policy`` is the K/D controller's own record (``shard.decode.control.SpecConfig``): the
    coordinator takes it as is, and a request may override it (``attrs.evolve``)."""

    draft: str = "none"
    draft_model: str | None = None
    draft_layers: int = 0
    policy: SpecConfig = attrs.field(factory=SpecConfig)
    oracle_file: str | None = None

    @property
    def uses_model(self) -> bool:
        return self.draft in ("model", "auto")


def read_speculation(table: Table, base_dir: Path | None) -> SpeculationSpec:
    """Validate ``[speculation]`` (an absent table reads as plain decoding)."""
    draft = table.string("draft", default="none", example='"auto"')
    if draft not in DRAFT_KINDS:
        raise table.error("draft", f"unknown draft {draft!r}; use one of {', '.join(DRAFT_KINDS)}")
    d = SpecConfig()
    k_max = table.integer("k_max", default=d.k_max, minimum=1)
    depth_max = table.integer("depth_max", default=d.depth_max, minimum=1)
    k = _auto_or_int(table, "k", minimum=0, maximum=k_max)
    depth = _auto_or_int(table, "depth", minimum=1, maximum=depth_max)
    layers = table.integer("draft_layers", default=0, minimum=0)
    model = table.raw("draft_model", None)
    if model is not None:
        model = table.string("draft_model")
        path = Path(model).expanduser()
        if not path.is_absolute():
            path = (base_dir if base_dir is not None else Path.cwd()) / path
        if not path.is_dir():
            raise table.error("draft_model", f"{str(path)!r} is not a checkpoint directory")
        model = str(path.resolve())
    if draft in ("model", "auto") and model is None and layers == 0:
        raise table.error(
            "draft",
            f'draft = "{draft}" needs a model: set draft_layers = N (the first N layers of '
            'the target + its head) or draft_model = "path"',
        )
    oracle = table.raw("oracle_file", None)
    if draft == "oracle":
        oracle = _oracle_file(table, base_dir)
    elif oracle is not None:
        raise table.error("oracle_file", 'only meaningful with draft = "oracle"')
    if draft == "none" and k not in (None, 0):
        raise table.error("k", 'k > 0 needs a draft; set draft = "ngram", "model" or "auto"')
    return SpeculationSpec(
        draft=draft,
        draft_model=model,
        draft_layers=layers,
        policy=SpecConfig(
            k=0 if draft == "none" else k,
            depth=1 if draft == "none" else depth,
            k_max=k_max,
            depth_max=depth_max,
        ),
        oracle_file=oracle,
    )


def _oracle_file(table: Table, base_dir: Path | None) -> str:
    """The oracle draft's references: a JSON file of ``{"references": [[ids...], ...]}``,
    each a prompt followed by a prior reference run's output. Benchmarks only: it replays
    known answers (α = 1) to measure the engine apart from draft quality."""
    text = table.string("oracle_file", example='"bench/results/oracle.json"')
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    if not path.is_file():
        raise table.error("oracle_file", f"{str(path)!r} does not exist")
    return str(path.resolve())


def _auto_or_int(table: Table, name: str, *, minimum: int, maximum: int) -> int | None:
    value = table.raw(name, None)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise table.error(name, f'expected "auto" or an integer {minimum}..{maximum}')
    if not minimum <= value <= maximum:
        raise table.error(name, f'must be in {minimum}..{maximum} (or "auto"), got {value}')
    return value

"""The ``[speculation]`` table of a swarm spec: which draft, how many tokens, how deep.

```toml
[speculation]
draft = "auto"          # none | ngram | model | auto (n-gram and model, chosen per round)
                        # | head (a draft head on the target's features) | hybrid (n-gram
                        # over long matches, the head elsewhere)
draft_layers = 6        # model draft = the target's first N layers + its head, or
draft_model = "path"    # a separate checkpoint sharing the target's tokenizer
draft_head = "smollm2-head"  # head / hybrid: a head directory, <bundled model>-head (the
                        # default: built on first use by `shard draft train`, then cached)
                        # or a shipped EAGLE-3 head, "smollm2-eagle3"
branch = true           # hybrid: until a reply shows whether it copies, a short lookup match
                        # the head outvotes rides beside the chunk as a branch (docs/drafts.md)
# draft = "eagle3" with draft_head = "DIR": a published EAGLE-3 head (SpecForge's layout) fed
#   the target's layer states, which the stages holding its layers send along; the bundled
#   SmolLM2's default is the shipped "smollm2-eagle3"
# draft = "mtp": the checkpoint's own MTP block (DeepSeek-V3, GLM-4.5), run at the tail after
#   the last layer (mtp_at = "tail", the default: verdicts carry its draft ids) or at the
#   coordinator, fed the tail's features (mtp_at = "coordinator"). With no draft given, a
#   checkpoint that holds an MTP block drafts with it (shard.nodes.defaults)
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

from shard.decode.control import SpeculationConfig
from shard.decode.head.shipped import is_eagle3_dir, shipped_head
from shard.spec.swarm_table import BUNDLED_MODELS
from shard.spec.validate import Table

DRAFT_KINDS: Final = (
    "none",
    "ngram",
    "model",
    "auto",
    "head",
    "hybrid",
    "eagle3",
    "mtp",
    "oracle",
)
SPECULATION_KEYS: Final = (
    "draft",
    "draft_model",
    "draft_layers",
    "draft_head",
    "k",
    "depth",
    "k_max",
    "depth_max",
    "oracle_file",
    "mtp_at",
    "branch",
)
MTP_PLACES: Final = ("tail", "coordinator")


@attrs.frozen
class SpeculationSpec:
    """Typed ``[speculation]``: which draft (``draft``, ``draft_model``, ``draft_layers``,
    ``oracle_file``) and how much to speculate (``policy``: ``k``, ``depth``, ``k_max``,
    ``depth_max``). Default: no drafting.

    ``policy`` is the K/D controller's own record (``shard.decode.control.SpeculationConfig``): the
    coordinator takes it as is, and a request may override it (``attrs.evolve``)."""

    draft: str = "none"
    draft_model: str | None = None
    draft_layers: int = 0
    policy: SpeculationConfig = attrs.field(factory=SpeculationConfig)
    oracle_file: str | None = None
    draft_head: str | None = None  # head / hybrid: a head directory or a head name; eagle3: a
    # head directory
    mtp_at: str = "tail"  # mtp: where the block runs (``MTP_PLACES``)
    branch: bool = True  # hybrid: send short lookup matches as branches early in a reply
    given: bool = False  # the table names a draft or k (else a checkpoint's MTP block may
    # default: shard.nodes.defaults)

    @property
    def uses_head(self) -> bool:
        return self.draft in ("head", "hybrid")

    @property
    def uses_model(self) -> bool:
        return self.draft in ("model", "auto")

    @property
    def mtp_at_tail(self) -> bool:
        """The tail runs the checkpoint's MTP block and returns its drafts."""
        return self.draft == "mtp" and self.mtp_at == "tail"


def read_speculation(
    table: Table, base_dir: Path | None, *, swarm_model: str | None = None
) -> SpeculationSpec:
    """Validate ``[speculation]`` (an absent table reads as plain decoding); ``swarm_model``
    is the swarm's (a bundled name gives head drafts their default, ``<model>-head``, and
    EAGLE-3 drafts ``<model>-eagle3`` where one is shipped)."""
    draft = table.string("draft", default="none", example='"auto"')
    if draft not in DRAFT_KINDS:
        raise table.error("draft", f"unknown draft {draft!r}; use one of {', '.join(DRAFT_KINDS)}")
    d = SpeculationConfig()
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
    head = _draft_head(table, draft, base_dir, swarm_model)
    oracle = table.raw("oracle_file", None)
    if draft == "oracle":
        oracle = _oracle_file(table, base_dir)
    elif oracle is not None:
        raise table.error("oracle_file", 'only meaningful with draft = "oracle"')
    mtp_at = table.string("mtp_at", default="tail", example='"tail"')
    if mtp_at not in MTP_PLACES:
        raise table.error("mtp_at", f"unknown place {mtp_at!r}; use one of {', '.join(MTP_PLACES)}")
    if draft != "mtp" and table.raw("mtp_at", None) is not None:
        raise table.error("mtp_at", 'only meaningful with draft = "mtp"')
    branch = table.boolean("branch", default=True)
    if draft != "hybrid" and table.raw("branch", None) is not None:
        raise table.error("branch", 'only meaningful with draft = "hybrid"')
    if draft == "none" and k not in (None, 0):
        raise table.error(
            "k",
            'k > 0 needs a draft; set draft = "ngram", "model", "auto", "head", "hybrid", '
            '"eagle3" or "mtp"',
        )
    return SpeculationSpec(
        draft=draft,
        draft_model=model,
        draft_layers=layers,
        policy=SpeculationConfig(
            k=0 if draft == "none" else k,
            depth=1 if draft == "none" else depth,
            k_max=k_max,
            depth_max=depth_max,
        ),
        oracle_file=oracle,
        draft_head=head,
        mtp_at=mtp_at,
        branch=branch,
        given=any(table.raw(key, None) is not None for key in ("draft", "k")),
    )


def _draft_head(table: Table, draft: str, base_dir: Path | None, model: str | None) -> str | None:
    """A head draft's head: ``draft_head`` as a directory (relative to the spec), a shipped
    EAGLE-3 head's name (``<model>-eagle3``, resolved to its directory) or a trained head's
    name (``<model>-head``). Defaults for a bundled model: ``<model>-eagle3`` for eagle3,
    ``<model>-head`` for head and hybrid. A trained head's training is not checked here: the
    coordinator builds a missing named head when it starts (``resolve_head``)."""
    text = table.raw("draft_head", None)
    if draft not in ("head", "hybrid", "eagle3"):
        if text is not None:
            raise table.error(
                "draft_head", 'only meaningful with draft = "head", "hybrid" or "eagle3"'
            )
        return None
    if text is None:
        default = f"{model}-eagle3" if draft == "eagle3" else f"{model}-head"
        if model not in BUNDLED_MODELS or (draft == "eagle3" and shipped_head(default) is None):
            raise table.error(
                "draft_head",
                f'draft = "{draft}" on a model with no head of its own needs draft_head = '
                '"DIR" (a head trained with `shard draft train --target MODEL --out DIR`, or '
                "an EAGLE-3 head in SpecForge's layout)",
            )
        text = default
    else:
        text = table.string("draft_head", example='"smollm2-eagle3"')
    if (shipped := shipped_head(text)) is not None:
        return str(shipped)
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    if draft == "eagle3" or path.is_dir():
        if not is_eagle3_dir(path) and draft == "eagle3":
            raise table.error("draft_head", f"{str(path)!r} is not an EAGLE-3 head directory")
        return str(path.resolve())
    if text.endswith("-head") and "/" not in text:
        return text  # a name: resolved (and built if missing) when the coordinator starts
    raise table.error(
        "draft_head",
        f"{text!r} is neither a head directory nor a head name like smollm2-head",
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

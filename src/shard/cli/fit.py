"""``shard plan --config FILE``: will a model fit these cards, and how would it be cut?

Before anyone downloads a weight: the model's ``config.json`` alone, a ``weights`` format and
each card's memory give every layer's bytes (``shard.model.footprint``), the contiguous split
whose largest stage holds the fewest bytes (``shard.placement.split.auto_counts``, the very
function that cuts a spec's ``layers = "auto"``; embedding and head counted) and a verdict.
What is left on each card is for the KV cache and the activations; the verdict says how much
and how many tokens of KV that is on the fullest card (``Footprint.kv``: MLA layers cache
their latent; linear-attention layers hold a state per session instead, ``Footprint.state``),
and the fewest cards of that size that would hold the weights when the asked
number does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shard.cli.errors import InputError, UsageError

_GIB = 1 << 30
#: ``plan --config``'s exit code when the asked cards do not hold the model.
NO_FIT = 3
_MAX_CARDS = 64


def fit_main(args: argparse.Namespace) -> int:
    """Print the per-stage bytes and the verdict; exit 0 when it fits, ``NO_FIT`` (3) when it
    does not (a script can tell without parsing the verdict), 1 for bad input."""
    from shard.model.config import ModelConfig, ModelLoadError
    from shard.model.footprint import FootprintError, predict
    from shard.placement import ModelFacts
    from shard.placement.problem import Sizes
    from shard.placement.split import auto_counts, blocks_of

    if args.spec is not None or args.rtt is not None:
        raise UsageError("--config plans from a config.json alone; leave out SPEC and --rtt")
    path = Path(args.config)
    directory = path if path.is_dir() else path.parent
    if not path.is_dir() and path.name != "config.json":
        raise UsageError(f"--config {path}: give a config.json or the directory holding one")
    try:
        config = ModelConfig.from_dir(directory)
        footprint = predict(config, args.weights, dtype=args.dtype)
    except (ModelLoadError, FootprintError) as exc:
        raise InputError(f"--config {path}: {exc}") from None
    memory = int(args.memory * _GIB)
    sizes = Sizes(footprint.layers, footprint.embedding, footprint.head, footprint.shared_head)
    model = ModelFacts.of_sizes(sizes)

    def split(cards: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        if not 1 <= cards <= config.n_layers:
            return None
        counts = auto_counts(model, [f"stage {i}" for i in range(cards)])  # layers = "auto"
        if counts is None:
            return None
        return counts, tuple(footprint.stage(a, b) for a, b in blocks_of(counts))

    asked = split(args.stages)
    if asked is None:
        raise UsageError(f"--stages {args.stages}: the model has {config.n_layers} layers")
    fewest = next(
        (n for n in range(1, min(config.n_layers, _MAX_CARDS) + 1)
         if (s := split(n)) is not None and max(s[1]) <= memory),
        None,
    )  # fmt: skip
    report = _report(config, footprint.total, args, asked, memory, fewest)
    for stage in report["stages"]:  # the KV a session's position adds there (MLA: its latent)
        stage["kv_bytes_per_token"] = footprint.kv(*stage["layers"])
        # and what a session holds there whatever its length (linear attention's state)
        stage["state_bytes_per_session"] = footprint.state(*stage["layers"])
    report["unquantized_bytes"] = footprint.unquantized
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_text(report))
    return 0 if report["fits"] else NO_FIT


def _report(
    config: Any,
    total: int,
    args: argparse.Namespace,
    asked: tuple[tuple[int, ...], tuple[int, ...]],
    memory: int,
    fewest: int | None,
) -> dict[str, Any]:
    from shard.placement.split import blocks_of

    counts, stage_bytes = asked
    stages = [
        {"layers": [a, b], "bytes": size, "fits": size <= memory, "left_bytes": memory - size}
        for (a, b), size in zip(blocks_of(counts), stage_bytes, strict=True)
    ]
    return {
        "model": str(args.config),
        "arch": config.arch,
        "layers": config.n_layers,
        "weights": args.weights,
        # a dense format is its own dtype (footprint.predict prices it so), whatever --dtype
        "dtype": args.weights if args.weights in ("float32", "bfloat16", "float16") else args.dtype,
        "total_bytes": total,
        "card_bytes": memory,
        "stages": stages,
        "fits": all(s["fits"] for s in stages),
        "fewest_cards": fewest,
    }


def gib(n: int) -> str:
    """``n`` bytes in GiB, two decimals."""
    return f"{n / _GIB:.2f} GiB"


def _text(r: dict[str, Any]) -> str:
    lines = [
        f"model:   {r['model']} ({r['arch']}, {r['layers']} layers): {gib(r['total_bytes'])} "
        f"of weights as {r['weights']}"
        + ("" if r["weights"] == r["dtype"] else f" (dense parts {r['dtype']})"),
        f"cards:   {len(r['stages'])} x {gib(r['card_bytes'])}; each stage's split minimises "
        "the largest stage's bytes (embedding on the first, head on the last)",
    ]
    for i, s in enumerate(r["stages"]):
        a, b = s["layers"]
        room = f"{gib(s['left_bytes'])} left" if s["fits"] else "DOES NOT FIT"
        lines.append(f"stage {i}: layers [{a}, {b})  {gib(s['bytes']):>12}  {room}")
    fewest = r["fewest_cards"]
    if r["unquantized_bytes"] > r["total_bytes"] // 20:
        lines.append(
            f"note:    {gib(r['unquantized_bytes'])} of it stays {r['dtype']} under "
            f"{r['weights']}: weights shard keeps dense (routers, expert biases; "
            "docs/model.md)"
        )
    if r["fits"]:
        fullest = min(r["stages"], key=lambda s: s["left_bytes"])
        worst, per_token = fullest["left_bytes"], fullest["kv_bytes_per_token"]
        state = fullest["state_bytes_per_session"]
        lines.append(
            f"verdict: fits; the fullest card keeps {gib(worst)} for its KV cache and activations"
            f" (its KV: {per_token / 1024:.1f} KiB a token, {worst // max(per_token, 1):,} "
            "tokens over all sessions at most"
            + (f"; and {state / (1 << 20):.1f} MiB a session for its linear-attention state)"
               if state else ")")
        )  # fmt: skip
    elif fewest is not None:
        lines.append(f"verdict: does not fit; {fewest} cards of this size would hold the weights")
    else:
        lines.append(
            f"verdict: does not fit on any number of cards of this size (up to {_MAX_CARDS}, "
            "one layer a card at most)"
        )
    return "\n".join(lines)

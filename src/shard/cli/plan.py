"""``shard plan [SPEC] [--rtt FILE]``: where the ring should run, and why (``shard.placement``).

The edge of the pure planner: it reads the spec and the geography file, turns them into a
``placement.Problem``, plans and prints. With SPEC the problem is ``shard.spec.layout``'s, the
one ``shard swarm up|run`` plan too (its candidates are the spec's stages and standbys, the
model its model, what the spec does not say assumed and printed), and the output ends with
the layout ``swarm up`` would run (``swarm up:``). With ``--rtt`` alone the geography is the
whole problem (nodes, model, coordinator places).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from shard.cli.errors import InputError, UsageError
from shard.placement import (
    Geography,
    ModelFacts,
    PlanError,
    Problem,
    plan,
    read_geography,
)
from shard.placement.report import as_json, text
from shard.spec.swarm import SwarmSpec


def plan_main(args: argparse.Namespace) -> int:
    """Plan and print; exit 0, or one ``shard: error:`` line (``PlanError``, bad files)."""
    if args.config is not None:
        from shard.cli.fit import fit_main

        return fit_main(args)
    if args.spec is None and args.rtt is None:
        raise UsageError("give a SPEC, an --rtt geography, or both (or --config FILE)")
    geography = read_geography_file(Path(args.rtt)) if args.rtt else None
    assumed: tuple[str, ...] = ()
    spec = None
    if args.spec is None:
        assert geography is not None
        problem = _from_geography(geography, args.rtt)
    else:
        from shard.spec.layout import problem_of
        from shard.spec.swarm import load_spec

        spec = load_spec(args.spec)
        written = spec.weights
        spec = with_weights(args.model or spec.model, spec)
        model = model_facts(args.model or spec.model, spec)
        problem, assumed = problem_of(spec, model, geography, rtt_source=args.rtt or "--rtt")
    if args.pin_boundaries:
        problem = attrs.evolve(problem, pin_boundaries=True)
    if args.coordinator is not None:
        if not problem.rtt.has(args.coordinator):
            raise PlanError(
                f"--coordinator {args.coordinator}: not a place the RTT matrix knows "
                f"({', '.join(problem.rtt.names)})"
            )
        problem = attrs.evolve(problem, coordinators=(args.coordinator,))
    chosen = plan(problem)
    decision = None
    if spec is not None and spec.formation is None and args.coordinator is None:
        from shard.spec.layout import decide

        decision = decide(spec, problem, chosen)
    if args.json:
        data = as_json(chosen, assumed=assumed)
        if decision is not None:
            layout = None if decision.layout is None else str(decision.layout)
            data["swarm_up"] = {"layout": layout, "why": decision.why}
        if spec is not None:
            data["weights"], data["dtype"] = spec.weights or spec.dtype, spec.dtype
        print(json.dumps(data, indent=2))
    else:
        regions = geography.regions if geography is not None else None
        print(text(chosen, assumed=assumed, regions=regions))
        if spec is not None:
            print(weights_line(spec, written))
        if decision is not None:
            print(decision.line())
    return 0


def read_geography_file(path: Path) -> Geography:
    """A geography from TOML (or JSON, by the ``.json`` suffix). Errors: ``InputError`` for
    a file that cannot be read or parsed, ``GeographyError`` for one that is not valid."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; give a geography (specs/geography/)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it: {e.strerror}") from None
    data: Any
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise InputError(f"{path}: invalid {kind}: {e}") from None
    if not isinstance(data, Mapping):
        raise InputError(f"{path}: not a table of keys; see docs/placement.md for the format")
    return read_geography(data, str(path))


def _from_geography(geography: Geography, source: str) -> Problem:
    if not geography.nodes:
        raise PlanError(f"{source}: no [[node]] tables; give nodes, or a SPEC to plan")
    if geography.model is None:
        raise PlanError(f"{source}: no [model] table; give one, or a SPEC whose model to plan")
    if not geography.coordinators:
        raise PlanError(f"{source}: no coordinators = [...]; name where it may run")
    return Problem(
        geography.nodes,
        geography.rtt,
        geography.model,
        geography.coordinators,
        geography.pin_boundaries,
    )


def with_weights(model: str, spec: SwarmSpec) -> SwarmSpec:
    """``spec`` with ``[swarm] weights`` defaulted from ``model``'s checkpoint (a bundled name
    or a directory), as every node of the swarm defaults it (``shard.nodes.defaults``)."""
    from shard.convert.bundled import resolve_model
    from shard.nodes.defaults import with_checkpoint_weights

    return with_checkpoint_weights(spec, resolve_model(model, progress=sys.stderr.isatty()))


def weights_line(spec: SwarmSpec, written: str | None) -> str:
    """How the swarm's nodes hold their weights (``spec`` from ``with_weights``; ``written``:
    the spec's own ``[swarm] weights``), beside the activations' dtype."""
    if written is not None:
        why = "[swarm] weights"
    elif spec.weights is not None:
        why = "the checkpoint's default: its quantized tensors as stored"
    else:
        why = "the checkpoint's default: dense in dtype"
    return f"weights:     {spec.weights or spec.dtype} ({why}); dtype {spec.dtype}"


def model_facts(model: str, spec: SwarmSpec) -> ModelFacts:
    """Each layer's, the embedding's and the head's bytes of ``model`` (a bundled name or a
    directory) as each node of ``spec`` holds them (``shard.nodes.sizes``), from its
    ``config.json`` (no weights are read; a ``"stored"`` format reads the headers)."""
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.nodes.sizes import model_facts as facts

    directory = resolve_model(model, progress=sys.stderr.isatty())
    return facts(ModelConfig.from_dir(directory), spec, directory)

"""``shard plan [SPEC] [--rtt FILE]``: where the ring should run, and why (``shard.placement``).

The edge of the pure planner: it reads the spec and the geography file, turns them into a
``placement.Problem``, plans and prints. With SPEC the candidates are its stages and standbys
and the model is its model; a node the geography does not profile is assumed (and the output
says so): as fast as every other, with room for the whole model, untrusted. Without ``--rtt``
the latencies are the spec's emulated ones (``[links]``: a hop's override, else the default).
With ``--rtt`` alone the geography is the whole problem (nodes, model, coordinator places).
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
    Candidate,
    Geography,
    ModelFacts,
    PlanError,
    Problem,
    RttMatrix,
    plan,
    read_geography,
)
from shard.placement.report import as_json, text

ASSUMED_MS_PER_LAYER = 1.0


def plan_main(args: argparse.Namespace) -> int:
    """Plan and print; exit 0, or one ``shard: error:`` line (``PlanError``, bad files)."""
    if args.spec is None and args.rtt is None:
        raise UsageError("give a SPEC, an --rtt geography, or both")
    geography = _read_file(Path(args.rtt)) if args.rtt else None
    assumed: list[str] = []
    if args.spec is None:
        assert geography is not None
        problem = _from_geography(geography, args.rtt)
    else:
        problem = _from_spec(args, geography, assumed)
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
    if args.json:
        print(json.dumps(as_json(chosen, assumed=assumed), indent=2))
    else:
        regions = geography.regions if geography is not None else None
        print(text(chosen, assumed=assumed, regions=regions))
    return 0


def _read_file(path: Path) -> Geography:
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


def _from_spec(
    args: argparse.Namespace, geography: Geography | None, assumed: list[str]
) -> Problem:
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    model = _model_facts(args.model or spec.model, spec.dtype)
    names = [s.name for s in spec.stages] + [s.name for s in spec.standbys if s.role != "auditor"]
    unprofiled = [n for n in names if geography is None or geography.node(n) is None]
    largest = max(last - first for first, last in spec.blocks(model.n_layers))
    room = largest * model.layer_bytes + model.embedding_bytes + model.head_bytes
    if unprofiled:
        assumed.append(
            f"{', '.join(unprofiled)}: {ASSUMED_MS_PER_LAYER} ms per layer (equal speeds), room "
            f"for {largest} layers (the spec's largest block) with the embedding and head, "
            "untrusted; give [[node]] profiles in an --rtt file"
        )
    candidates = tuple(_candidate(n, geography, room) for n in names)
    coordinators: tuple[str, ...] = (spec.coordinator.name,)
    if geography is None:
        rtt = _spec_rtt(spec)
        assumed.append(
            "latencies from the spec's [links] (one way; a hop without an override has the "
            f"default {spec.default_latency_ms} ms, and so does every pair not in its ring)"
        )
    else:
        rtt = geography.rtt
        missing = [n for n in (spec.coordinator.name, *names) if not rtt.has(n)]
        if missing:
            raise PlanError(
                f"{args.rtt}: rtt.nodes has no {', '.join(missing)} (nodes of {args.spec}); "
                "add their rows and columns"
            )
        coordinators += tuple(c for c in geography.coordinators if c != spec.coordinator.name)
        if geography.model is not None:
            assumed.append(f"the model is {args.spec}'s, not the [model] of {args.rtt}")
    return Problem(
        candidates, rtt, model, coordinators, geography.pin_boundaries if geography else False
    )


def _candidate(name: str, geography: Geography | None, room: int) -> Candidate:
    found = geography.node(name) if geography is not None else None
    if found is not None:
        return found
    return Candidate(name, room, ASSUMED_MS_PER_LAYER, ASSUMED_MS_PER_LAYER)


def _spec_rtt(spec: Any) -> RttMatrix:
    """Round trips from the spec's one-way link latencies: twice the hop's (or the default)."""
    names = [
        spec.coordinator.name,
        *(s.name for s in spec.stages),
        *(s.name for s in spec.standbys),
    ]
    overrides = {(e.src, e.dst): e.latency_ms for e in spec.edges}
    rows = []
    for a in names:
        row = []
        for b in names:
            one_way = overrides.get((a, b), spec.default_latency_ms)
            row.append(0.0 if a == b else 2.0 * one_way)
        rows.append(tuple(row))
    return RttMatrix(tuple(names), tuple(rows))


def _model_facts(model: str, dtype: str) -> ModelFacts:
    """Layer, embedding and head sizes of ``model`` (a bundled name or a directory) in
    ``dtype``, from its ``config.json`` (no weights are read)."""
    from shard.model.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.profile import weight_bytes

    config = ModelConfig.from_dir(resolve_model(model, progress=sys.stderr.isatty()))
    return ModelFacts(config.n_layers, *weight_bytes(config, dtype))

"""``shard up``: one node of a swarm (coordinator, stage, standby, auditor or seeder), as its
spec names it or joining a forming swarm (``--join``), until stopped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from shard.cli.errors import UsageError
from shard.cli.swarm import laid_out, model_dir_of, with_api
from shard.nodes.launcher import REPLACED_EXIT


def up(args: argparse.Namespace) -> int:
    if args.die_with_parent is not None:  # first, so even a slow start is covered
        from shard.nodes.lifeline import die_with_parent

        die_with_parent(args.die_with_parent, args.node or args.role)
    if args.role == "seeder":  # serves manifest chunks; no ring role (shard.cli.weights)
        from shard.cli.weights import seeder_main

        return seeder_main(args)
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    if args.layout is not None:
        spec = laid_out(spec, args.layout)
    name = args.node or spec.coordinator.name
    if args.join is not None:
        spec = _joined(spec, args)
    weights = getattr(args, "weights", None)
    if args.role != "seeder" and (args.device or args.dtype or args.graphs or weights):
        spec = spec.with_runtime(
            name, device=args.device, dtype=args.dtype, graphs=args.graphs, weights=weights
        )
    if args.role == "coordinator" and name != spec.coordinator.name:
        print(f"shard: error: {name} is not the coordinator of {args.spec}", file=sys.stderr)
        return 2
    if args.role == "stage" and not args.join and name not in {s.name for s in spec.stages}:
        names = ", ".join(s.name for s in spec.stages)
        print(f"shard: error: no stage {name!r} in {args.spec} (stages: {names})", file=sys.stderr)
        return 2
    if args.role in ("standby", "auditor"):
        found = [s for s in spec.standbys if s.role == args.role]
        if name not in {s.name for s in found}:
            names = ", ".join(s.name for s in found) or "none"
            print(
                f"shard: error: no {args.role} {name!r} in {args.spec} ([[standby]] tables "
                f'with role = "{args.role}": {names})',
                file=sys.stderr,
            )
            return 2
    if spec.insecure and args.die_with_parent is None:  # under swarm up|run: it warns once
        print(
            f"shard: WARNING: {name}: insecure = true — plaintext, unauthenticated wire; "
            "for local development only",
            file=sys.stderr,
        )
    if args.role == "coordinator" and args.api is not None:
        spec = with_api(spec, args.api)
    if args.join is not None and _joined_fetches(spec, name):
        model_dir = Path(args.model or spec.model)  # never read: it fetches its block
    else:
        model_dir = model_dir_of(args.model, spec.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        trio.run(_run_node, spec, name, args, model_dir)
    except (Exception, BaseExceptionGroup) as exc:
        replaced = _replaced(exc)
        if replaced is None:
            raise
        # Declared dead (it froze) or evicted (an audit caught it), and a standby holds its
        # slot: the swarm decided so, and the run goes on. Said as what happened, not as an
        # error of a run that may well succeed; its own exit code (the launcher logs it).
        print(f"shard: {replaced}", file=sys.stderr)
        return REPLACED_EXIT
    return 0


def _replaced(exc: BaseException) -> BaseException | None:
    """The ``NodeReplaced`` that ``exc`` is (or, a group, that all its leaves are)."""
    from shard.cli.errors import leaves
    from shard.failover.control import NodeReplaced

    found = list(leaves(exc))
    if found and all(isinstance(leaf, NodeReplaced) for leaf in found):
        return found[0]
    return None


def _joined(spec: Any, args: argparse.Namespace) -> Any:
    """The spec as a node started with ``--join`` sees it (``shard.nodes.joining``).

    Errors: ``UsageError`` for ``--join`` without ``--role stage`` or ``--node``."""
    from shard.nodes.joining import joined_spec

    if args.role != "stage" or not args.node:
        raise UsageError("--join needs --role stage and --node NAME (this node's name)")
    key, token = (Path(p).resolve() if p else None for p in (args.key, args.token))
    return joined_spec(spec, args.node, join=args.join, listen=args.listen, key=key, token=token)


def _joined_fetches(spec: Any, name: str) -> bool:
    """Whether a ``--join`` node fetches its weights per ``[fetch]`` (``shard.nodes.joining``)."""
    from shard.nodes.joining import fetches_weights

    return fetches_weights(spec, name)


async def _ports_free(spec: Any, name: str, *, api: bool, standby: bool = False) -> None:
    """Fail now, in one line, when a port this node will listen on is taken: before its
    weights load (seconds to minutes), not after. Each port is bound and let go at once; a
    program that takes it in between is still reported when the node binds it for good.

    Errors: ``ListenError`` (``shard.transport.base``), naming the address and what to do."""
    from shard.transport.base import open_listeners, split_address

    me = spec.coordinator
    if standby:  # a standby coordinator listens at its own addresses, not the primary's
        addresses = [str(a) for a in (me.standby, me.standby_api) if a is not None]
    else:
        addresses = [str(spec.node(name).listen)]
        if api and spec.api.listen is not None:
            addresses.append(str(spec.api.listen))
    for address in addresses:
        if split_address(address)[1] == 0:  # any free port: nothing to check
            continue
        for listener in await open_listeners(address):
            await listener.aclose()


async def _run_node(spec: Any, name: str, args: argparse.Namespace, model_dir: Path) -> None:
    from shard.compute.collector import settle
    from shard.nodes.compose import node_network
    from shard.nodes.coordinator import run_coordinator, run_stage, run_standby
    from shard.nodes.launcher import ready_line

    # WebSocketNetwork when insecure = true, else the node's key + token on the secure wire
    # (a standby is admitted as a stage: it becomes one when the scheduler activates it; an
    # auditor holds a stage's block and talks to the scheduler as a standby does)
    role = "stage" if args.role in ("standby", "auditor") else args.role
    standby = bool(getattr(args, "standby_of", None))
    await _ports_free(spec, name, api=args.role == "coordinator", standby=standby)
    network = node_network(spec, name, role)
    async with network, trio.open_nursery() as nursery:
        if args.join:
            from shard.nodes.joining import run_joined

            memory = None if args.memory_gib is None else int(args.memory_gib * (1 << 30))
            handle = await nursery.start(
                lambda task_status: run_joined(
                    spec,
                    name,
                    network=network,
                    model_dir=model_dir,
                    memory_bytes=memory,
                    startup_timeout_s=args.startup_timeout,
                    task_status=task_status,
                )
            )
        elif args.role in ("standby", "auditor"):
            handle = await nursery.start(
                lambda task_status: run_standby(
                    spec,
                    name,
                    network=network,
                    model_dir=model_dir,
                    startup_timeout_s=args.startup_timeout,
                    task_status=task_status,
                )
            )
        elif args.role == "stage":
            handle = await nursery.start(
                lambda task_status: run_stage(
                    spec,
                    name,
                    network=network,
                    model_dir=model_dir,
                    successor=args.successor,
                    startup_timeout_s=args.startup_timeout,
                    task_status=task_status,
                )
            )
        elif getattr(args, "standby_of", None):
            from shard.nodes.standby_coordinator import run_standby_coordinator

            await nursery.start(
                lambda task_status: run_standby_coordinator(
                    spec,
                    network=network,
                    model_dir=model_dir,
                    primary=args.standby_of,
                    startup_timeout_s=args.startup_timeout,
                    task_status=task_status,
                )
            )
            settle()  # full collections stay short while it serves (shard.compute.collector)
            print(ready_line(name, str(spec.coordinator.standby)), flush=True)
            return
        else:
            handle = await nursery.start(
                lambda task_status: run_coordinator(
                    spec,
                    network=network,
                    model_dir=model_dir,
                    successor=args.successor,
                    startup_timeout_s=args.startup_timeout,
                    task_status=task_status,
                )
            )
        settle()  # full collections stay short while it serves (shard.compute.collector)
        print(ready_line(name, handle.address, getattr(handle, "api", None)), flush=True)

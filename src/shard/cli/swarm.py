"""``shard up`` (one node), ``shard swarm up|run`` (a whole local swarm) and ``shard monitor``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from shard.cli.generate import ask, client_address, read_prompts, sampling
from shard.messages import GenerateRequest


def _model_dir(model: str | None, spec_model: str) -> Path:
    if model is not None:
        return Path(model)
    from shard.model.bundled import resolve_model

    return resolve_model(spec_model)


def up(args: argparse.Namespace) -> int:
    if args.role == "seeder":  # serves manifest chunks; no ring role (shard.cli.weights)
        from shard.cli.weights import seeder_main

        return seeder_main(args)
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    name = args.node or spec.coordinator.name
    if args.role != "seeder" and (args.device or args.dtype or args.graphs):
        spec = spec.with_runtime(name, device=args.device, dtype=args.dtype, graphs=args.graphs)
    if args.role == "coordinator" and name != spec.coordinator.name:
        print(f"shard: error: {name} is not the coordinator of {args.spec}", file=sys.stderr)
        return 2
    if args.role == "stage" and name not in {s.name for s in spec.stages}:
        names = ", ".join(s.name for s in spec.stages)
        print(f"shard: error: no stage {name!r} in {args.spec} (stages: {names})", file=sys.stderr)
        return 2
    if args.role == "standby" and name not in {s.name for s in spec.standbys}:
        names = ", ".join(s.name for s in spec.standbys) or "none"
        print(
            f"shard: error: no standby {name!r} in {args.spec} ([[standby]] tables: {names})",
            file=sys.stderr,
        )
        return 2
    if spec.insecure:
        print(
            f"shard: WARNING: {name}: insecure = true — plaintext, unauthenticated wire; "
            "for local development only",
            file=sys.stderr,
        )
    model_dir = _model_dir(args.model, spec.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    trio.run(_run_node, spec, name, args, model_dir)
    return 0


async def _run_node(spec: Any, name: str, args: argparse.Namespace, model_dir: Path) -> None:
    from shard.nodes.coordinator import run_coordinator, run_stage, run_standby
    from shard.nodes.launcher import ready_line
    from shard.trust.compose import node_network

    # WebSocketNetwork when insecure = true, else the node's key + token on the secure wire
    # (a standby is admitted as a stage: it becomes one when the scheduler activates it)
    role = "stage" if args.role == "standby" else args.role
    network = node_network(spec, name, role)
    async with network, trio.open_nursery() as nursery:
        if args.role == "standby":
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
        print(ready_line(name, handle.address), flush=True)


def swarm(args: argparse.Namespace) -> int:
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    model_dir = _model_dir(getattr(args, "model", None), spec.model)
    if args.swarm_command == "up" and args.monitor:
        from shard.observe.tui.main import monitor_swarm
        from shard.transport import WebSocketNetwork

        address = client_address(str(spec.coordinator.listen))
        network = WebSocketNetwork(connect_timeout_s=spec.limits.connect_timeout_s)
        monitor_swarm(Path(args.spec), spec, model_dir=model_dir, address=address, network=network)
        return 0
    if args.swarm_command == "up":
        trio.run(_swarm_up, Path(args.spec), spec, model_dir)
        return 0
    prompts = [args.prompt] if args.prompt is not None else read_prompts(Path(args.prompts))
    failed = trio.run(_swarm_run, Path(args.spec), spec, model_dir, prompts, args)
    return 1 if failed else 0


def monitor(args: argparse.Namespace) -> int:
    """``shard monitor ADDRESS --swarm NAME`` or ``shard monitor --spec SPEC``."""
    timeout_s = 10.0
    if args.spec is not None:
        from shard.spec.swarm import load_spec

        spec = load_spec(args.spec)
        address = args.address or client_address(str(spec.coordinator.listen))
        swarm = args.swarm or spec.name
        timeout_s = spec.limits.connect_timeout_s
    elif args.address is None or args.swarm is None:
        print(
            "shard: error: give --spec SPEC, or ADDRESS and --swarm NAME (the handshake names "
            "the swarm), e.g. shard monitor 127.0.0.1:7700 --swarm local",
            file=sys.stderr,
        )
        return 2
    else:
        address, swarm = args.address, args.swarm
    from shard.observe.tui.main import monitor
    from shard.transport import WebSocketNetwork

    network = WebSocketNetwork(connect_timeout_s=timeout_s)
    monitor(address, swarm=swarm, network=network, connect_timeout_s=timeout_s)
    return 0


async def _swarm_up(spec_path: Path, spec: Any, model_dir: Path) -> None:
    from shard.nodes.launcher import launch

    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            lambda task_status: launch(
                spec_path, spec, model_dir=model_dir, task_status=task_status
            )
        )
        pids = " ".join(f"{n}={p}" for n, p in handle.pids.items())
        print(f"SHARD SWARM UP coordinator={handle.coordinator} {pids}", flush=True)
        for relay in handle.relays:
            print(f"  relay {relay}", file=sys.stderr)
        print("swarm is up; Ctrl-C stops every node", file=sys.stderr)


async def _swarm_run(
    spec_path: Path, spec: Any, model_dir: Path, prompts: list[str], args: argparse.Namespace
) -> int:
    from shard.failover.script import Progress, run_faults
    from shard.nodes.launcher import launch

    failed = 0
    progress = Progress()
    fired: list[Any] = []

    def report(line: str) -> None:
        print(f"shard: fault: {line}", file=sys.stderr, flush=True)

    async def faults() -> None:
        await run_faults(handle, progress, report, fired)

    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            lambda task_status: launch(
                spec_path, spec, model_dir=model_dir, task_status=task_status
            )
        )
        if spec.faults:
            nursery.start_soon(faults)
        for i, prompt in enumerate(prompts, start=1):
            req = GenerateRequest(
                i,
                prompt,
                args.max_tokens,
                sampling(args),
                chat=args.chat,
                receipt=bool(args.receipt),
                k=-1 if args.k is None else args.k,
                depth=args.depth or 0,
            )
            timeout_s = spec.limits.connect_timeout_s
            progress.begin()
            done = await ask(spec, handle.coordinator, req, args, timeout_s, progress.add)
            failed += done.finish_reason == "error"
        nursery.cancel_scope.cancel()
    for f in fired:
        pause = progress.longest_pause_after(f.at)
        report(f"longest pause between tokens after {f.fault.kind} {f.fault.node}: {pause:.3f} s")
    if spec.faults and len(fired) < len(spec.faults):
        report(f"{len(spec.faults) - len(fired)} scripted fault(s) never triggered")
    return failed

"""``shard swarm up|run`` (a whole local swarm) and ``shard monitor``; ``shard up`` (one node) is
``shard.cli.up``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import trio

from shard.cli.errors import UsageError
from shard.cli.generate import ask, client_address, read_prompts, sampling
from shard.cli.inputs import prompt_arg
from shard.messages import GenerateRequest

#: What stops ``swarm up|run``, every node with it: Ctrl-C, ``kill``, a closed terminal. SIGINT
#: is taken even when a shell started us in the background with it ignored: sent on purpose,
#: it is a request to stop (a terminal's Ctrl-C reaches only foreground jobs either way).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def model_dir_of(model: str | None, spec_model: str) -> Path:
    if model is not None:
        return Path(model)
    from shard.convert.bundled import resolve_model

    return resolve_model(spec_model)


def with_api(spec: Any, text: str) -> Any:
    """``spec`` serving the HTTP API at ``--api`` ``HOST:PORT`` (or a bare port: loopback).

    Errors: ``SpecError`` for a bad address, or a public one without keys."""
    import attrs

    from shard.spec.api import check_exposure, parse_api_address
    from shard.spec.swarm import SpecError

    try:
        listen = parse_api_address(text)
    except ValueError as exc:
        raise SpecError("--api", "", f"{exc}; e.g. --api 127.0.0.1:8000") from None
    spec = attrs.evolve(spec, api=spec.api.serving(listen))
    check_exposure("--api", spec.api)
    return spec


def laid_out(spec: Any, text: str) -> Any:
    """``spec`` running the ring ``--layout`` gives. Errors: ``SpecError`` for a bad one."""
    from shard.spec.layout import Layout, apply_layout
    from shard.spec.swarm import SpecError

    try:
        layout = Layout.parse(text)
    except ValueError as exc:
        raise SpecError(spec.source, "--layout", str(exc)) from None
    return apply_layout(spec, layout)


def planned(spec: Any, model_dir: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    """``spec`` as ``swarm up|run`` run it, and the layout its nodes get (None: as written):
    planned as ``shard plan SPEC [--rtt FILE]`` plans it (``shard.spec.layout``); with
    ``--rtt`` the ring's hops get the geography's latencies. Nothing is planned for
    ``--as-written`` or a ``[formation]`` swarm.

    On stderr: the plan and the decision with ``--verbose``; without it, only a decision that
    changes what runs (the plan's layout) or says why no plan was made — the answer comes
    first, not ~20 lines of a plan that keeps the spec as written.

    A spec no plan can be made for (``PlanError`` from the planner) runs as written, saying
    why. Errors: ``PlanError`` (a geography without the spec's nodes), ``GeographyError``,
    ``InputError`` (a bad ``--rtt`` file), ``UsageError`` (``--rtt`` with a formation swarm)."""
    rtt = getattr(args, "rtt", None)
    if spec.formation is not None:
        if rtt is not None:
            raise UsageError("--rtt plans a written ring; a [formation] swarm places its nodes")
        return spec, None
    if getattr(args, "as_written", False):
        return spec, None
    from shard.cli.plan import model_facts, read_geography_file, weights_line
    from shard.nodes.defaults import with_checkpoint_weights
    from shard.placement import PlanError, plan
    from shard.placement.report import text
    from shard.spec.layout import Decision, apply_layout, decide, problem_of, with_links

    geography = read_geography_file(Path(rtt)) if rtt is not None else None
    held = with_checkpoint_weights(spec, model_dir)  # as its nodes will: plan what they hold
    model = model_facts(str(model_dir), held)
    problem, assumed = problem_of(spec, model, geography, rtt_source=rtt or "--rtt")
    verbose = getattr(args, "verbose", False)
    try:
        chosen = plan(problem)
        decision = decide(spec, problem, chosen)
    except PlanError as exc:  # e.g. more stages than the exact search takes: run as written
        decision = Decision(None, f"no plan: {exc}")
        verbose = True  # why it runs as written, in one line
    else:
        regions = geography.regions if geography is not None else None
        if verbose:
            print(text(chosen, assumed=assumed, regions=regions), file=sys.stderr)
            print(weights_line(held, spec.weights), file=sys.stderr)
    if verbose or decision.layout is not None:
        print(decision.line(), file=sys.stderr, flush=True)
    if decision.layout is not None:
        spec = apply_layout(spec, decision.layout)
    if geography is not None:
        spec = with_links(spec, geography.rtt)
    return spec, decision.layout


def swarm(args: argparse.Namespace) -> int:
    from shard.spec.swarm import load_spec

    prompts: list[str] = []
    if args.swarm_command == "run":  # bad input fails before any model or process starts
        if args.prompt is not None:
            prompts = [prompt_arg(args.prompt)]
        else:
            prompts = read_prompts(Path(args.prompts))
    spec = load_spec(args.spec)
    _warn_insecure(spec)
    model_dir = model_dir_of(getattr(args, "model", None), spec.model)
    if args.swarm_command == "up" and args.monitor and args.api is not None:
        print(
            "shard: error: --api and --monitor do not go together yet; set [api] listen in "
            "the spec instead (docs/api.md)",
            file=sys.stderr,
        )
        return 2
    spec, layout = planned(spec, model_dir, args)
    if args.swarm_command == "up" and args.monitor:
        from shard.nodes.compose import client_network
        from shard.observe.tui.main import monitor_swarm

        address = client_address(str(spec.coordinator.listen))
        network = client_network(spec, role="monitor")  # secure: [trust] client_key/_token
        from shard.nodes.launcher import launch

        start = partial(launch, Path(args.spec), spec, model_dir=model_dir, layout=layout)
        monitor_swarm(
            Path(args.spec),
            swarm=spec.name,
            start=start,
            address=address,
            network=network,
            connect_timeout_s=spec.limits.connect_timeout_s,
        )
        return 0
    if args.swarm_command == "up":
        if args.api is not None:
            with_api(spec, args.api)  # refuse a bad address here, before any node starts
        return trio.run(_swarm_up, Path(args.spec), spec, model_dir, args.api, layout)
    return trio.run(_swarm_run, Path(args.spec), spec, model_dir, prompts, args, layout)


def _warn_insecure(spec: Any) -> None:
    """One warning for the whole swarm (its nodes, started with ``--die-with-parent``, keep
    quiet) when ``insecure = true`` and a node listens beyond loopback: there the plaintext
    wire is reachable from other machines. On loopback only it is the documented local
    setup, nothing to act on."""
    from shard.spec.api import is_loopback

    nodes = (spec.coordinator, *spec.stages, *spec.standbys)
    exposed = [n.name for n in nodes if not is_loopback(n.listen.host)]
    if spec.insecure and exposed:
        print(
            f"shard: WARNING: insecure = true and {', '.join(exposed)} listen beyond "
            "loopback: a plaintext, unauthenticated wire other machines can reach; give the "
            "swarm a [trust] table (docs/security.md) or listen on 127.0.0.1",
            file=sys.stderr,
        )


def monitor(args: argparse.Namespace) -> int:
    """``shard monitor ADDRESS --swarm NAME`` or ``shard monitor --spec SPEC`` (a secure
    swarm's spec: with ``--key``/``--token``, or its ``[trust] client_key``/``client_token``,
    admitting role monitor).

    Errors: ``UsageError`` for a missing address or ``--key``/``--token`` without ``--spec``
    (the secure wire needs the spec's authority).
    """
    from shard.observe.tui.main import monitor
    from shard.transport import Network, WebSocketNetwork

    network: Network
    if args.spec is not None:
        from shard.nodes.compose import client_network
        from shard.spec.swarm import load_spec

        spec = load_spec(args.spec)
        address = args.address or client_address(str(spec.coordinator.listen))
        swarm = args.swarm or spec.name
        timeout_s = spec.limits.connect_timeout_s
        key, token = (Path(p) if p else None for p in (args.key, args.token))
        network = client_network(spec, key=key, token=token, role="monitor")
    elif args.key is not None or args.token is not None:
        raise UsageError(
            "--key/--token need --spec: the secure wire checks the coordinator against the "
            "spec's [trust] authority"
        )
    elif args.address is None or args.swarm is None:
        raise UsageError(
            "give --spec SPEC, or ADDRESS and --swarm NAME (the handshake names the swarm), "
            "e.g. shard monitor 127.0.0.1:7700 --swarm local"
        )
    else:
        address, swarm, timeout_s = args.address, args.swarm, 10.0
        network = WebSocketNetwork(connect_timeout_s=timeout_s)
    monitor(address, swarm=swarm, network=network, connect_timeout_s=timeout_s)
    return 0


async def _stop_on_signal(
    signals: AsyncIterator[int], scope: trio.CancelScope, stopped: list[int]
) -> None:
    """Cancel ``scope`` (which stops every node) on the first of ``STOP_SIGNALS``."""
    async for signum in signals:
        stopped.append(signum)
        scope.cancel()
        return


def _exit_code(stopped: list[int], failed: int = 0) -> int:
    """128 + the signal that stopped the swarm (the shell's convention), else 1 if a request
    failed, else 0."""
    if stopped:
        return 128 + stopped[0]
    return 1 if failed else 0


async def _swarm_up(
    spec_path: Path, spec: Any, model_dir: Path, api: str | None, layout: Any
) -> int:
    """Run the swarm until a stop signal or an error; a stage's or standby's death is one
    ``SHARD NODE EXITED`` line and failover, not the end."""
    from shard.nodes.launcher import NodeExit, launch

    async def print_exits(exits: trio.MemoryReceiveChannel[NodeExit]) -> None:
        async with exits:
            async for node in exits:
                print(node.line(), flush=True)

    stopped: list[int] = []
    exits_send, exits = trio.open_memory_channel[NodeExit](16)
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope, stopped)
            nursery.start_soon(print_exits, exits)
            handle = await nursery.start(
                lambda task_status: launch(
                    spec_path,
                    spec,
                    model_dir=model_dir,
                    api=api,
                    exits=exits_send,
                    layout=layout,
                    task_status=task_status,
                )
            )
            pids = " ".join(f"{n}={p}" for n, p in handle.pids.items())
            served = f" api={handle.api}" if handle.api else ""
            print(f"SHARD SWARM UP coordinator={handle.coordinator}{served} {pids}", flush=True)
            if handle.api:
                print(f"chat page: {handle.api}/  (OpenAI API: {handle.api}/v1)", file=sys.stderr)
            for relay in handle.relays:
                print(f"  relay {relay}", file=sys.stderr)
            print("swarm is up; Ctrl-C (or SIGTERM, SIGHUP) stops every node", file=sys.stderr)
    return _exit_code(stopped)


async def _swarm_run(
    spec_path: Path,
    spec: Any,
    model_dir: Path,
    prompts: list[str],
    args: argparse.Namespace,
    layout: Any,
) -> int:
    from shard.nodes.launcher import launch
    from shard.nodes.script import Fired, Progress, run_faults

    failed = 0
    progress = Progress()
    fired: list[Fired] = []
    stopped: list[int] = []

    def report(line: str) -> None:
        print(f"shard: fault: {line}", file=sys.stderr, flush=True)

    async def faults() -> None:
        await run_faults(handle, progress, report, fired)

    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope, stopped)
            handle = await nursery.start(
                lambda task_status: launch(
                    spec_path, spec, model_dir=model_dir, layout=layout, task_status=task_status
                )
            )
            if spec.faults:
                nursery.start_soon(faults)
            for i, prompt in enumerate(prompts, start=1):
                progress.begin()
                done = await ask(
                    spec,
                    handle.coordinator,
                    _request(i, prompt, args),
                    args,
                    spec.limits.connect_timeout_s,
                    progress,
                )
                failed += done.finish_reason == "error"
            nursery.cancel_scope.cancel()
    if stopped:
        return _exit_code(stopped)
    for f in fired:
        pause = progress.longest_pause_after(f.at)
        report(f"longest pause between tokens after {f.fault.kind} {f.fault.node}: {pause:.3f} s")
    if spec.faults and len(fired) < len(spec.faults):
        report(f"{len(spec.faults) - len(fired)} scripted fault(s) never triggered")
    return _exit_code(stopped, failed)


def _request(i: int, prompt: str, args: argparse.Namespace) -> GenerateRequest:
    return GenerateRequest(
        i,
        prompt,
        args.max_tokens,
        sampling(args),
        chat=args.chat,
        receipt=bool(args.receipt),
        k=-1 if args.k is None else args.k,
        depth=args.depth or 0,
        ignore_eos=args.ignore_eos,
    )

"""Handlers of the ``shard`` subcommands (parsing lives in ``cli``).

Every handler returns an exit code. Errors an operator can hit (a bad spec, a missing model,
an unreachable node, a failed request) are printed as one ``shard: error: ...`` line with exit
code 1 (2 for usage errors); anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from shard.messages import GenerateDone, GenerateRequest, Sampling, TokensOut

log = logging.getLogger("shard")


def _operator_errors() -> tuple[type[BaseException], ...]:
    from shard.coordinator.client import ClientError
    from shard.coordinator.router import RingError
    from shard.decode.state import BadRequest
    from shard.failover.control import NodeReplaced
    from shard.model.bundled import ModelNotFound
    from shard.model.loader import ModelLoadError
    from shard.nodes.launcher import SwarmError
    from shard.spec.swarm import SpecError
    from shard.transport import TransportError
    from shard.transport.links import HandshakeError
    from shard.trust.identity import IdentityError
    from shard.weights.fetch import FetchError
    from shard.weights.manifest import ManifestError

    return (
        SpecError,
        ModelLoadError,
        ModelNotFound,
        SwarmError,
        TransportError,
        HandshakeError,  # also every refusal of the secure wire (shard.trust.admission, channel)
        IdentityError,
        RingError,
        ClientError,
        BadRequest,
        ManifestError,
        FetchError,
        NodeReplaced,
        trio.TooSlowError,
    )


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def dispatch(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = {
        "generate": _generate,
        "keygen": _keygen,
        "admit": _admit,
        "up": _up,
        "swarm": _swarm,
        "monitor": _monitor,
        "receipt": _receipt,
        "manifest": _manifest,
        "fetch": _fetch,
    }[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        known = _operator_errors()
        leaves = list(_leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
            return 130
        if leaves and all(isinstance(leaf, known) for leaf in leaves):
            for leaf in leaves:
                print(f"shard: error: {leaf}", file=sys.stderr)
            return 1
        raise


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _stats_dict(stats: Any) -> dict[str, Any]:
    return attrs.asdict(stats, recurse=True)


def _print_done(done: GenerateDone, *, as_json: bool, streamed: bool) -> None:
    if as_json:
        record = {
            "token_ids": list(done.token_ids),
            "text": done.text,
            "finish_reason": done.finish_reason,
            "stats": _stats_dict(done.stats),
        }
        if done.error:
            record["error"] = done.error
        print(json.dumps(record), flush=True)
        return
    if not streamed:
        print(done.text, end="")
    print(flush=True)
    if done.finish_reason == "error":
        print(f"shard: error: {done.error}", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    if args.local:
        return _generate_local(args)
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    if args.receipt and args.local:
        print(
            "shard: error: --receipt needs a ring (--spec); --local has no stages", file=sys.stderr
        )
        return 2
    request = GenerateRequest(
        request=1,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=_sampling(args),
        chat=args.chat,
        receipt=bool(args.receipt),
        k=-1 if args.k is None else args.k,
        depth=args.depth or 0,
    )
    address = _client_address(str(spec.coordinator.listen))
    done = trio.run(_ask, spec, address, request, args, spec.limits.connect_timeout_s)
    return 0 if done.finish_reason != "error" else 1


def _client_address(address: str) -> str:
    """A listen address made dialable (a wildcard bind is reached on loopback locally)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "") else address


async def _ask(
    spec: Any,
    address: str,
    req: GenerateRequest,
    args: Any,
    connect_timeout_s: float,
    on_tokens: Callable[[int], None] | None = None,
) -> GenerateDone:
    """Send one request to the coordinator at ``address``; the spec's ``connect_timeout_s``
    bounds reaching it (a swarm that is not running fails fast, with one line)."""
    from shard.coordinator.client import request
    from shard.trust.compose import client_network

    def show(out: TokensOut) -> None:
        if on_tokens is not None:
            on_tokens(len(out.token_ids))
        if not args.json:
            print(out.text, end="", flush=True)

    # insecure = false: this client's own key and token (--key/--token or [trust] client_*)
    key, token = getattr(args, "key", None), getattr(args, "token", None)
    network = client_network(
        spec, key=Path(key) if key else None, token=Path(token) if token else None
    )
    async with network:
        done = await request(
            network,
            address,
            req,
            swarm=spec.name,
            on_text=show,
            connect_timeout_s=connect_timeout_s,
            handshake_timeout_s=spec.limits.handshake_timeout_s,
        )
    _print_done(done, as_json=args.json, streamed=True)
    out = getattr(args, "receipt", None)
    if out and done.receipt:
        path = _receipt_path(Path(out), req.request)
        path.write_text(done.receipt)
        print(f"shard: receipt written to {path}", file=sys.stderr)
    return done


def _receipt_path(out: Path, request: int) -> Path:
    """OUT for the first request, OUT.<n>.json for later ones (``swarm run --prompts``)."""
    return out if request == 1 else out.with_name(f"{out.name}.{request}.json")


def _receipt(args: argparse.Namespace) -> int:
    from shard.trust.receipts import ReceiptInvalid, RunReceipt, verify_run

    try:
        receipt = RunReceipt.from_json(Path(args.file).read_text())
        verify_run(receipt)
    except (OSError, ReceiptInvalid) as exc:
        print(f"shard: receipt INVALID: {args.file}: {exc}", file=sys.stderr)
        return 1
    stages = ", ".join(f"{s.node}[{s.first},{s.last})" for s in receipt.stages)
    print(
        f"receipt OK: job {receipt.job}, {len(receipt.output_ids)} tokens, "
        f"{receipt.n_layers} layers over {stages}; coordinator {receipt.coordinator} "
        f"ed25519:{receipt.coordinator_key[:16]}"
    )
    return 0


def _generate_local(args: argparse.Namespace) -> int:
    from shard.coordinator.service import prompt_ids
    from shard.decode.reference import generate_reference
    from shard.model.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage
    from shard.model.tokenizer import StreamDecoder, Tokenizer

    model_dir = resolve_model(args.model)
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    max_len = args.max_len or min(2048, config.max_position_embeddings)
    if max_len > config.max_position_embeddings:
        print(
            f"shard: error: --max-len {max_len} exceeds the model's context length "
            f"{config.max_position_embeddings}",
            file=sys.stderr,
        )
        return 2
    req = GenerateRequest(1, args.prompt, args.max_tokens, _sampling(args), chat=args.chat)
    stream = StreamDecoder(tokenizer)

    def show(ids: list[int]) -> None:
        if not args.json:
            print("".join(stream.push(t) for t in ids), end="", flush=True)

    result = generate_reference(
        model,
        prompt_ids(tokenizer, req),
        max_tokens=args.max_tokens,
        eos_ids=(*config.eos_token_ids, *tokenizer.eos_ids),
        sampling=req.sampling,
        max_len=max_len,
        on_tokens=show,
    )
    done = GenerateDone(
        request=1,
        token_ids=result.token_ids,
        text=tokenizer.decode(result.token_ids),
        finish_reason=result.finish_reason,
        stats=result.stats,
    )
    _print_done(done, as_json=args.json, streamed=True)
    return 0


def _model_dir(model: str | None, spec_model: str) -> Path:
    if model is not None:
        return Path(model)
    from shard.model.bundled import resolve_model

    return resolve_model(spec_model)


def _up(args: argparse.Namespace) -> int:
    if args.role == "seeder":  # serves manifest chunks; no ring role (shard.cli.weights)
        from shard.cli.weights import seeder_main

        return seeder_main(args)
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    name = args.node or spec.coordinator.name
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


def _swarm(args: argparse.Namespace) -> int:
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    model_dir = _model_dir(getattr(args, "model", None), spec.model)
    if args.swarm_command == "up" and args.monitor:
        from shard.observe.tui.main import monitor_swarm
        from shard.transport import WebSocketNetwork

        address = _client_address(str(spec.coordinator.listen))
        network = WebSocketNetwork(connect_timeout_s=spec.limits.connect_timeout_s)
        monitor_swarm(Path(args.spec), spec, model_dir=model_dir, address=address, network=network)
        return 0
    if args.swarm_command == "up":
        trio.run(_swarm_up, Path(args.spec), spec, model_dir)
        return 0
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(Path(args.prompts))
    failed = trio.run(_swarm_run, Path(args.spec), spec, model_dir, prompts, args)
    return 1 if failed else 0


def _monitor(args: argparse.Namespace) -> int:
    """``shard monitor ADDRESS --swarm NAME`` or ``shard monitor --spec SPEC``."""
    timeout_s = 10.0
    if args.spec is not None:
        from shard.spec.swarm import load_spec

        spec = load_spec(args.spec)
        address = args.address or _client_address(str(spec.coordinator.listen))
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


def _read_prompts(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


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
                _sampling(args),
                chat=args.chat,
                receipt=bool(args.receipt),
                k=-1 if args.k is None else args.k,
                depth=args.depth or 0,
            )
            timeout_s = spec.limits.connect_timeout_s
            progress.begin()
            done = await _ask(spec, handle.coordinator, req, args, timeout_s, progress.add)
            failed += done.finish_reason == "error"
        nursery.cancel_scope.cancel()
    for f in fired:
        pause = progress.longest_pause_after(f.at)
        report(f"longest pause between tokens after {f.fault.kind} {f.fault.node}: {pause:.3f} s")
    if spec.faults and len(fired) < len(spec.faults):
        report(f"{len(spec.faults) - len(fired)} scripted fault(s) never triggered")
    return failed


def _keygen(args: argparse.Namespace) -> int:
    from shard.trust.compose import keygen

    return keygen(Path(args.out))


def _admit(args: argparse.Namespace) -> int:
    from shard.trust.compose import admit

    try:
        return admit(
            authority=Path(args.authority),
            node_pub=args.node_pub,
            swarm=args.swarm,
            roles=args.roles,
            expires=args.expires,
            out=Path(args.out),
            serial=args.serial,
        )
    except ValueError as exc:
        print(f"shard admit: error: {exc}", file=sys.stderr)
        return 2


def _manifest(args: argparse.Namespace) -> int:
    from shard.cli.weights import manifest_main

    return manifest_main(args)


def _fetch(args: argparse.Namespace) -> int:
    from shard.cli.weights import fetch_main

    return fetch_main(args)

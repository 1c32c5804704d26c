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
    from shard.client import ClientError
    from shard.config import SpecError
    from shard.coordinator import RingError
    from shard.decoding import BadRequest
    from shard.links import HandshakeError
    from shard.model.bundled import ModelNotFound
    from shard.model.loader import ModelLoadError
    from shard.node import StageLinkLost
    from shard.swarm import SwarmError
    from shard.transport import TransportError

    return (
        SpecError,
        ModelLoadError,
        ModelNotFound,
        SwarmError,
        TransportError,
        HandshakeError,
        RingError,
        ClientError,
        BadRequest,
        StageLinkLost,
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
        "up": _up,
        "swarm": _swarm,
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
    from shard.config import load_spec

    spec = load_spec(args.spec)
    request = GenerateRequest(
        request=1,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=_sampling(args),
        chat=args.chat,
    )
    done = trio.run(_ask, spec.name, _client_address(str(spec.coordinator.listen)), request, args)
    return 0 if done.finish_reason != "error" else 1


def _client_address(address: str) -> str:
    """A listen address made dialable (a wildcard bind is reached on loopback locally)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "") else address


async def _ask(swarm: str, address: str, req: GenerateRequest, args: Any) -> GenerateDone:
    from shard.client import request
    from shard.transport import WebSocketNetwork

    def show(out: TokensOut) -> None:
        if not args.json:
            print(out.text, end="", flush=True)

    async with WebSocketNetwork() as network:
        done = await request(network, address, req, swarm=swarm, on_text=show)
    _print_done(done, as_json=args.json, streamed=True)
    return done


def _generate_local(args: argparse.Namespace) -> int:
    from shard.model.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage
    from shard.model.tokenizer import StreamDecoder, Tokenizer
    from shard.reference import generate_reference
    from shard.service import prompt_ids

    model_dir = resolve_model(args.model)
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
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
        max_len=args.max_len,
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
    from shard.config import load_spec

    spec = load_spec(args.spec)
    name = args.node or spec.coordinator.name
    if args.role == "coordinator" and name != spec.coordinator.name:
        print(f"shard: error: {name} is not the coordinator of {args.spec}", file=sys.stderr)
        return 2
    if args.role == "stage" and name not in {s.name for s in spec.stages}:
        names = ", ".join(s.name for s in spec.stages)
        print(f"shard: error: no stage {name!r} in {args.spec} (stages: {names})", file=sys.stderr)
        return 2
    if spec.insecure:
        print(
            f"shard: WARNING: {name}: insecure = true — plaintext, unauthenticated wire; "
            "for local development only",
            file=sys.stderr,
        )
    model_dir = _model_dir(args.model, spec.model)
    trio.run(_run_node, spec, name, args, model_dir)
    return 0


async def _run_node(spec: Any, name: str, args: argparse.Namespace, model_dir: Path) -> None:
    from shard.node import run_coordinator, run_stage
    from shard.swarm import ready_line
    from shard.transport import WebSocketNetwork

    network = WebSocketNetwork(connect_timeout_s=spec.limits.connect_timeout_s)
    async with network, trio.open_nursery() as nursery:
        if args.role == "stage":
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
    from shard.config import load_spec

    spec = load_spec(args.spec)
    model_dir = _model_dir(getattr(args, "model", None), spec.model)
    if args.swarm_command == "up":
        trio.run(_swarm_up, Path(args.spec), spec, model_dir)
        return 0
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(Path(args.prompts))
    failed = trio.run(_swarm_run, Path(args.spec), spec, model_dir, prompts, args)
    return 1 if failed else 0


def _read_prompts(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


async def _swarm_up(spec_path: Path, spec: Any, model_dir: Path) -> None:
    from shard.swarm import launch

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
    from shard.swarm import launch

    failed = 0
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            lambda task_status: launch(
                spec_path, spec, model_dir=model_dir, task_status=task_status
            )
        )
        for i, prompt in enumerate(prompts, start=1):
            req = GenerateRequest(i, prompt, args.max_tokens, _sampling(args), chat=args.chat)
            done = await _ask(spec.name, handle.coordinator, req, args)
            failed += done.finish_reason == "error"
        nursery.cancel_scope.cancel()
    return failed

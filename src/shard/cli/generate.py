"""``shard generate``: one request to a running swarm (``--spec``) or the single-process
reference (``--local``), and the request plumbing ``swarm run`` shares."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from shard.cli.errors import UsageError
from shard.cli.inputs import prompt_arg
from shard.cli.inputs import read_prompts as read_prompts
from shard.messages import GenerateDone, GenerateRequest, Sampling

if TYPE_CHECKING:
    from shard.nodes.script import Progress

log = logging.getLogger(__name__)


def sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _stats_dict(stats: Any) -> dict[str, Any]:
    return attrs.asdict(stats, recurse=True)


def print_done(done: GenerateDone, *, as_json: bool, streamed: bool) -> None:
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


def generate(args: argparse.Namespace) -> int:
    """``shard generate``: ``--local`` runs the reference here, ``--spec`` asks a swarm.

    Errors: ``UsageError`` for an option the chosen mode does not use (refused, never
    silently ignored); ``InputError`` for a prompt that is not UTF-8.
    """
    refuse_inapplicable(args)
    prompt = prompt_arg(args.prompt)
    if args.local:
        return _generate_local(args, prompt)
    from shard.spec.swarm import load_spec

    spec = load_spec(args.spec)
    request = GenerateRequest(
        request=1,
        prompt=prompt,
        max_tokens=args.max_tokens,
        sampling=sampling(args),
        chat=args.chat,
        receipt=bool(args.receipt),
        k=-1 if args.k is None else args.k,
        depth=args.depth or 0,
        ignore_eos=args.ignore_eos,
    )
    address = client_address(str(spec.coordinator.listen))
    done = trio.run(ask, spec, address, request, args, spec.limits.connect_timeout_s)
    return 0 if done.finish_reason != "error" else 1


#: Options of one mode only: (flag, its ``args`` attribute, why the other mode has no use).
_RING_ONLY = (
    ("--receipt", "receipt", "--local has no stages to sign one"),
    ("--key", "key", "--local talks to no swarm"),
    ("--token", "token", "--local talks to no swarm"),
    ("--k", "k", "--local runs no speculation"),
    ("--depth", "depth", "--local runs no speculation"),
)
_LOCAL_ONLY = (
    ("--model", "model", "a swarm's model is its spec's swarm.model"),
    ("--max-len", "max_len", "a swarm's KV length is its spec's limits.max_len"),
    ("--weights", "weights", "a swarm's nodes take theirs from its spec's swarm.weights"),
)


def refuse_inapplicable(args: argparse.Namespace) -> None:
    """Errors: ``UsageError`` naming an option given that the chosen mode would ignore."""
    other = "--spec" if args.local else "--local"
    for flag, attr, why in _RING_ONLY if args.local else _LOCAL_ONLY:
        if getattr(args, attr, None) is not None:
            raise UsageError(f"{flag} applies only with {other}: {why}")


def client_address(address: str) -> str:
    """A listen address made dialable (a wildcard bind is reached on loopback locally)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "") else address


async def ask(
    spec: Any,
    address: str,
    req: GenerateRequest,
    args: Any,
    connect_timeout_s: float,
    progress: Progress | None = None,
) -> GenerateDone:
    """Send one request to the coordinator at ``address`` and print its text as it commits;
    the spec's ``connect_timeout_s`` bounds reaching it (a swarm that is not running fails
    fast, with one line). ``progress`` (``swarm run``) records when each commit arrived.

    Errors: ``ClientError`` at once when the coordinator's connection closes mid-request (it
    stopped or was killed: its socket closes with it), after ending any streamed text's
    line so the error is a line of its own."""
    from shard.coordinator.client import ClientError, stream
    from shard.nodes.compose import client_network
    from shard.transport import ConnectionClosed

    streamed = False
    done: GenerateDone | None = None
    # insecure = false: this client's own key and token (--key/--token or [trust] client_*)
    key, token = getattr(args, "key", None), getattr(args, "token", None)
    network = client_network(
        spec, key=Path(key) if key else None, token=Path(token) if token else None
    )
    try:
        async with network:
            # a standby coordinator in the spec: the client goes on there if this one dies
            standby = spec.coordinator.standby
            addresses = address if standby is None else (address, str(standby))
            async with stream(
                network,
                addresses,
                req,
                swarm=spec.name,
                connect_timeout_s=connect_timeout_s,
                handshake_timeout_s=spec.limits.handshake_timeout_s,
            ) as pieces:
                async for piece in pieces:
                    if isinstance(piece, GenerateDone):
                        done = piece
                        continue
                    if progress is not None:
                        progress.add(len(piece.token_ids))
                    if not args.json:
                        print(piece.text, end="", flush=True)
                        streamed = streamed or bool(piece.text)
    except ConnectionClosed as exc:
        if streamed:
            print(flush=True)
        raise ClientError(
            f"the coordinator at {address} closed the connection before the request finished "
            f"({exc}): it stopped or was killed; see its log, restart the swarm and retry"
        ) from None
    if done is None:
        raise ClientError(f"the coordinator at {address} ended request {req.request} unfinished")
    print_done(done, as_json=args.json, streamed=True)
    out = getattr(args, "receipt", None)
    if out and done.receipt is not None:
        from shard.trust.receipt_check import receipt_to_json

        path = _receipt_path(Path(out), req.request)
        path.write_text(receipt_to_json(done.receipt))
        print(f"shard: receipt written to {path}", file=sys.stderr)
    return done


def _receipt_path(out: Path, request: int) -> Path:
    """OUT for the first request, OUT.<n>.json for later ones (``swarm run --prompts``)."""
    return out if request == 1 else out.with_name(f"{out.name}.{request}.json")


def _generate_local(args: argparse.Namespace, prompt: str) -> int:
    from torch import float32

    from shard.convert.bundled import resolve_model
    from shard.coordinator.service import prompt_ids
    from shard.decode.reference import reference_steps
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage
    from shard.model.tokenizer import StreamDecoder, Tokenizer
    from shard.model.weights import resolve_weights

    model_dir = resolve_model(args.model or "smollm2")
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    max_len = args.max_len or min(2048, config.max_position_embeddings)
    if max_len > config.max_position_embeddings:
        print(
            f"shard: error: --max-len {max_len} exceeds the model's context length "
            f"{config.max_position_embeddings}",
            file=sys.stderr,
        )
        return 2
    req = GenerateRequest(
        1, prompt, args.max_tokens, sampling(args), chat=args.chat, ignore_eos=args.ignore_eos
    )
    ids = prompt_ids(tokenizer, req)  # a chat template's refusal before the weights load
    weights = resolve_weights(args.weights, model_dir, float32)  # as load_stage does
    log.info("%s: weights %s, dtype float32", model_dir.name, weights)
    model = load_stage(model_dir, 0, config.n_layers, weights=weights)
    text = StreamDecoder(tokenizer)
    steps = reference_steps(
        model,
        ids,
        max_tokens=args.max_tokens,
        eos_ids=() if req.ignore_eos else (*config.eos_token_ids, *tokenizer.eos_ids),
        sampling=req.sampling,
        max_len=max_len,
    )
    for emitted in steps:
        if not args.json:
            print("".join(text.push(t) for t in emitted), end="", flush=True)
    result = steps.result
    done = GenerateDone(
        request=1,
        token_ids=result.token_ids,
        text=tokenizer.decode(result.token_ids),
        finish_reason=result.finish_reason,
        stats=result.stats,
    )
    print_done(done, as_json=args.json, streamed=True)
    return 0

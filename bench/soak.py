"""A soak with churn, at scale (issue 40, point 3): many stage processes, many API clients,
for hours, while nodes are killed, frozen and joined.

The swarm forms itself: a coordinator (with ``[ledger] receipts``: every request signed and
kept) and ``--stages + --standbys`` nodes that ``--join`` it (``[formation] stages`` fixes the
ring's size; the rest stand by). ``--clients`` clients then stream completions through the
HTTP API (greedy, one of ``PROMPTS`` each time) until ``--hours`` have passed, and every
``--churn-s`` seconds one event happens, in turn:

- ``kill``: SIGKILL a random ring stage (a standby takes its block), then a fresh node joins;
- ``freeze``: SIGSTOP a random ring stage for ``3 x dead_after_s`` (declared dead, replaced;
  woken, it learns it was replaced and exits 3), then a fresh node joins;
- ``join``: a fresh node joins (the pool of standbys grows by one);
- ``coordinator``: with ``--standby-coordinator``, SIGKILL the coordinator driving the ring.

Recorded: every request (identical to ``shard generate --local``, wrong, failed with why and
the text committed before, retried after a 503 or a lost coordinator), tokens per minute,
every process's RSS and open file descriptors every ``--sample-s``, every event, and at the
end ``shard ledger`` over the receipt log against the tokens the clients received. Writes
JSON (``--json``) and an SVG of tok/s and RSS over time next to it; prints a summary.

A benchmark, not a test: it asserts nothing and records everything. Run it alone. SIGUSR1
ends it early, as ``--hours`` would (no new requests; one in flight retries for two minutes
more, not ten; the result says when).

    .venv/bin/python bench/soak.py --hours 2 --stages 16 --standbys 4 --clients 16 \
        --json bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import trio

HERE = Path(__file__).resolve().parent
PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the factorial of n.",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):",
    "The water cycle describes how water",
    "A haiku about autumn:",
    "To make a cup of tea, first",
)
SPEC = """\
[swarm]
name = "soak"
model = "{model}"
insecure = true

[limits]
max_len = 512
max_sessions = {sessions}

[coordinator]
name = "coord"
listen = "127.0.0.1:{coord}"
key = "coord.key"
{standby}
[api]
listen = "127.0.0.1:{api}"
max_sessions = {sessions}

[formation]
expect = {expect}
stages = {stages}
wait_s = 900.0
probes = 3

[failover]
heartbeat_s = 0.5
dead_after_s = {dead_after}
join_deadline_s = 120.0

[ledger]
receipts = "receipts"
"""


@attrs.define
class Node:
    name: str
    role: str  # "coordinator", "standby-coordinator", "stage"
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    ended: float | None = None
    exit_code: int | None = None
    samples: list[tuple[float, float, int]] = attrs.Factory(list)  # (t, rss MiB, fds)


class Swarm:
    """The processes, started and signalled by name; every one killed by PID on close."""

    def __init__(self, work: Path, spec: Path, args: argparse.Namespace) -> None:
        self.work, self.spec, self.args = work, spec, args
        self.nodes: dict[str, Node] = {}
        self.joined = 0
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _start(self, name: str, role: str, argv: list[str]) -> Node:
        log = self.work / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "shard", *argv],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        node = Node(name, role, proc, log, self.now())
        self.nodes[name] = node
        return node

    def coordinator(self) -> Node:
        argv = ["up", "--role", "coordinator", "--spec", str(self.spec), "--threads", "1"]
        return self._start("coord", "coordinator", argv)

    def standby_coordinator(self) -> Node:
        argv = ["up", "--role", "coordinator", "--spec", str(self.spec), "--threads", "1"]
        argv += ["--standby-of", f"127.0.0.1:{self.args.port}"]
        return self._start("coord-standby", "standby-coordinator", argv)

    def join(self) -> Node:
        name = f"n{self.joined}"
        self.joined += 1
        argv = ["up", "--role", "stage", "--spec", str(self.spec), "--node", name]
        argv += ["--join", f"127.0.0.1:{self.args.port}", "--threads", "1"]
        argv += ["--memory-gib", "1"]
        return self._start(name, "stage", argv)

    def alive(self, role: str | None = None) -> list[Node]:
        out = []
        for node in self.nodes.values():
            if node.ended is None and node.proc.poll() is not None:
                node.ended, node.exit_code = self.now(), node.proc.returncode
            if node.ended is None and (role is None or node.role == role):
                out.append(node)
        return out

    def signal(self, name: str, sig: signal.Signals) -> None:
        try:
            os.killpg(self.nodes[name].proc.pid, sig)
        except ProcessLookupError:
            pass

    def sample(self) -> None:
        """RSS (MiB) and open file descriptors of every live process (/proc)."""
        t = self.now()
        for node in self.alive():
            try:
                status = Path(f"/proc/{node.proc.pid}/status").read_text()
                rss_kib = next(int(x.split()[1]) for x in status.splitlines() if x[:6] == "VmRSS:")
                fds = len(os.listdir(f"/proc/{node.proc.pid}/fd"))
            except (OSError, StopIteration):
                continue
            node.samples.append((round(t, 1), round(rss_kib / 1024, 1), fds))

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                self.signal(node.name, signal.SIGCONT)
                self.signal(node.name, signal.SIGKILL)
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@attrs.define
class Tally:
    """What the clients saw. ``requests``: one dict per request, as recorded."""

    requests: list[dict[str, Any]] = attrs.Factory(list)
    tokens_at: list[tuple[float, int]] = attrs.Factory(list)  # (t, completion tokens) per request
    events: list[dict[str, Any]] = attrs.Factory(list)
    ring: tuple[str, ...] = ()
    clients_from: float | None = None  # when the clients started (the swarm had formed)
    stopped_early: float | None = None  # SIGUSR1: no new requests from then on


def _http(
    method: str,
    url: str,
    body: dict[str, Any] | None,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    return urllib.request.urlopen(req, timeout=timeout_s)  # loopback only


def stream_once(
    api: str, model: str, prompt: str, max_tokens: int, resume: str | None = None
) -> dict[str, Any]:
    """One streamed completion (blocking; run in a thread): the text committed, the usage,
    the resume key and token count (docs/api.md, "Resuming a stream"), and how it ended
    ("done", or the error). ``resume``: ``KEY:N`` of a broken stream to go on with. Never
    raises for what the server or the connection did: that is the record."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage, ended = "", None, "connection closed before [DONE]"
    key, tokens = None, 0
    headers = {} if resume is None else {"x-shard-resume": resume}
    try:
        with _http("POST", f"{api}/v1/completions", body, 600.0, headers) as resp:
            key = resp.headers.get("x-shard-resume-key")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    ended = "done"
                    break
                event = json.loads(payload)
                if "error" in event:
                    ended = f"error: {event['error'].get('message', event['error'])}"
                    break
                if event.get("usage"):
                    usage = event["usage"]
                tokens = (event.get("shard") or {}).get("tokens", tokens)
                for choice in event.get("choices", ()):
                    text += choice.get("text") or ""
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "text": "", "ended": exc.read().decode(errors="replace")}
    except (OSError, ValueError) as exc:
        got = {"status": 0, "text": text, "ended": f"{type(exc).__name__}: {exc}"}
        return got | {"key": key, "tokens": tokens}
    if ended == "connection closed before [DONE]":  # a clean close mid-stream: broken too
        return {"status": 0, "text": text, "ended": ended, "key": key, "tokens": tokens}
    got = {"status": 200, "text": text, "usage": usage, "ended": ended}
    return got | {"key": key, "tokens": tokens}


async def client(
    index: int, apis: list[str], want: dict[str, str], args: argparse.Namespace,
    tally: Tally, swarm: Swarm, stop_at: float,
) -> None:  # fmt: skip
    rng = random.Random(f"{args.seed}-client-{index}")
    while swarm.now() < stop_at and tally.stopped_early is None:
        prompt = rng.choice(PROMPTS)
        record: dict[str, Any] = {"client": index, "prompt": prompt, "sent": swarm.now()}
        retries: Counter[str] = Counter()
        before, resume = "", None  # the text of broken streams, and how to go on
        while True:
            got = await trio.to_thread.run_sync(
                stream_once, apis[0], args.model_id, prompt, args.max_tokens, resume
            )
            late = swarm.now() > stop_at + 600 or (
                tally.stopped_early is not None and swarm.now() > tally.stopped_early + 120
            )  # a request in flight gets ten minutes past the end (two past SIGUSR1)
            if got["status"] in (503, 429) and not late:
                retries[str(got["status"])] += 1  # the ring is repairing, or full: wait
                await trio.sleep(1.0)
                continue
            if got["status"] == 0 and len(apis) > 1 and not late:
                if got["key"] is not None:  # a stream broke: go on from what arrived
                    retries["resumed"] += 1
                    before += got["text"]
                    resume = f"{got['key']}:{got['tokens']}"
                else:  # never admitted (the coordinator is down): the other one
                    retries["coordinator"] += 1
                apis.reverse()
                await trio.sleep(1.0)
                continue
            break
        got["text"] = before + got["text"]
        record |= {"done": swarm.now(), "retries": dict(retries), "status": got["status"]}
        if got["status"] == 200 and got["ended"] == "done":
            record["outcome"] = "identical" if got["text"] == want[prompt] else "wrong"
            if record["outcome"] == "wrong":
                record |= {"text": got["text"], "want": want[prompt]}
            tokens = (got["usage"] or {}).get("completion_tokens", 0)
            record["tokens"] = tokens
            tally.tokens_at.append((swarm.now(), tokens))
        else:
            record |= {"outcome": "failed", "why": got["ended"][:300]}
            record["committed"] = got["text"]
            record["prefix_ok"] = want[prompt].startswith(got["text"])
        tally.requests.append(record)


async def churn(swarm: Swarm, tally: Tally, args: argparse.Namespace, stop_at: float) -> None:
    rng = random.Random(f"{args.seed}-churn")
    kinds = ["kill", "freeze", "join"] + (["coordinator"] if args.standby_coordinator else [])
    turn = 0
    while True:
        await trio.sleep(args.churn_s)
        if swarm.now() >= stop_at:
            return
        kind = kinds[turn % len(kinds)]
        turn += 1
        event: dict[str, Any] = {"t": round(swarm.now(), 1), "kind": kind}
        ring = [n for n in tally.ring if n in swarm.nodes and swarm.nodes[n].ended is None]
        if kind in ("kill", "freeze") and ring:
            victim = rng.choice(ring)
            event["node"] = victim
            if kind == "kill":
                swarm.signal(victim, signal.SIGKILL)
            else:
                swarm.signal(victim, signal.SIGSTOP)
                await trio.sleep(3 * args.dead_after_s)
                swarm.signal(victim, signal.SIGCONT)
            event["joined"] = swarm.join().name
        elif kind == "join":
            event["joined"] = swarm.join().name
        elif kind == "coordinator":  # once: nothing stands by for the one that took over
            live = swarm.alive("coordinator")
            if live and swarm.alive("standby-coordinator"):
                swarm.signal(live[0].name, signal.SIGKILL)
                event["node"] = live[0].name
                swarm.nodes["coord-standby"].role = "coordinator"
                kinds.remove("coordinator")
        tally.events.append(event)
        print(f"[{event['t']:8.1f} s] {event}", flush=True)


async def stop_on_signal(swarm: Swarm, tally: Tally) -> None:
    """SIGUSR1: the clients send no new request (those in flight finish); the run ends as
    at ``--hours`` and says when it stopped (``stopped_early``)."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            tally.stopped_early = swarm.now()
            print(f"[{swarm.now():8.1f} s] SIGUSR1: no new requests", flush=True)
            return


async def watch_ring(spec_path: Path, tally: Tally, address: str) -> None:
    """Keep ``tally.ring`` current from the coordinator's status feed."""
    from shard.messages import StatusSnapshot
    from shard.nodes.compose import client_network
    from shard.observe.tui.feed import FeedWatcher
    from shard.spec.swarm import load_spec

    spec = load_spec(spec_path)

    def post(event: object) -> None:
        if isinstance(event, StatusSnapshot):
            tally.ring = tuple(str(n) for n in event.ring[1:])

    async with client_network(spec, role="monitor") as network:
        await FeedWatcher(network, swarm=spec.name, post=post, node="soak-monitor").run(address)


async def sampler(swarm: Swarm, every_s: float) -> None:
    while True:
        swarm.sample()
        await trio.sleep(every_s)


def references(model: str, max_tokens: int) -> dict[str, str]:
    """``shard generate --local`` of every prompt: what each request must return."""
    out = {}
    for prompt in PROMPTS:
        done = subprocess.run(
            [sys.executable, "-m", "shard", "generate", "--local", "--model", model,
             "--max-tokens", str(max_tokens), "--json", prompt],
            capture_output=True, text=True, timeout=900, check=True,
        )  # fmt: skip
        out[prompt] = json.loads(done.stdout)["text"]
    return out


async def wait_ready(api: str, timeout_s: float, swarm: Swarm) -> None:
    with trio.fail_after(timeout_s):
        while True:
            try:
                with await trio.to_thread.run_sync(_http, "GET", f"{api}/health", None, 5.0):
                    return
            except (OSError, ValueError):
                if not swarm.alive("coordinator"):
                    why = "the coordinator exited during formation (see its log)"
                    raise SystemExit(why) from None
                await trio.sleep(2.0)


def model_id(api: str) -> str:
    """The id the API serves (``/v1/models``): what every request names."""
    with _http("GET", f"{api}/v1/models", None, 10.0) as resp:
        return str(json.load(resp)["data"][0]["id"])


def ledger_totals(folder: Path, key: Path) -> dict[str, Any]:
    from shard.trust.identity import NodeIdentity

    pub = NodeIdentity.load(key).public.hex()
    done = subprocess.run(
        [sys.executable, "-m", "shard", "ledger", str(folder), "--coordinator", pub, "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if not done.stdout.strip():
        return {"error": done.stderr.strip()[-2000:]}
    book = json.loads(done.stdout)
    return {"totals": book["totals"], "refused": book["refused"][:20], "rows": len(book["rows"])}


def rss_growth(nodes: list[Node], warmup_s: float) -> dict[str, float]:
    """Per process alive past ``warmup_s``: RSS at its end over RSS at ``warmup_s`` (medians of
    the samples in the first and last ten percent after it), as a percentage."""
    out = {}
    for node in nodes:
        after = [rss for t, rss, _ in node.samples if t - node.started >= warmup_s]
        if len(after) < 4:
            continue
        tenth = max(1, len(after) // 10)
        first, last = sorted(after[:tenth])[tenth // 2], sorted(after[-tenth:])[tenth // 2]
        out[node.name] = round(100.0 * (last - first) / first, 2)
    return out


def per_minute(tokens_at: list[tuple[float, int]]) -> list[tuple[int, float]]:
    buckets: Counter[int] = Counter()
    for t, n in tokens_at:
        buckets[int(t // 60)] += n
    return [(m, round(buckets[m] / 60.0, 2)) for m in range(max(buckets, default=-1) + 1)]


def svg(
    tok_s: list[tuple[int, float]], rss: list[list[tuple[float, float, int]]], out: Path
) -> None:
    """Two panels, by hand (no plotting library here): tok/s per minute, and every process's
    RSS over time."""
    w, h, pad = 900, 220, 40
    end = max([m * 60 for m, _ in tok_s] + [t for n in rss for t, _, _ in n] + [60])

    def line(points: list[tuple[float, float]], top: float, y0: int, colour: str) -> str:
        if len(points) < 2 or top <= 0:
            return ""
        xy = " ".join(
            f"{pad + (w - 2 * pad) * x / end:.1f},{y0 + h - pad - (h - 2 * pad) * y / top:.1f}"
            for x, y in points
        )
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1" points="{xy}"/>'

    top_tok = max((v for _, v in tok_s), default=0.0)
    top_rss = max((r for n in rss for _, r, _ in n), default=0.0)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{2 * h}">',
        f'<text x="{pad}" y="20">tokens/s per minute (max {top_tok:.1f}); '
        f"x: 0 to {end / 60:.0f} min</text>",
        line([(m * 60.0, v) for m, v in tok_s], top_tok, 0, "#1f77b4"),
        f'<text x="{pad}" y="{h + 20}">RSS of each process, MiB (max {top_rss:.0f})</text>',
    ]
    parts += [line([(t, r) for t, r, _ in n], top_rss, h, "#d62728") for n in rss]
    out.write_text("\n".join([*parts, "</svg>"]) + "\n")


def summary(tally: Tally, swarm: Swarm, ledger: dict[str, Any], args: argparse.Namespace,
            load: tuple[float, float, float]) -> dict[str, Any]:  # fmt: skip
    outcomes = Counter(r["outcome"] for r in tally.requests)
    why = Counter(r.get("why", "") for r in tally.requests if r["outcome"] == "failed")
    retried = Counter(k for r in tally.requests for k in r["retries"])
    client_tokens = sum(r.get("tokens", 0) for r in tally.requests)
    ended = max((r["done"] for r in tally.requests), default=swarm.now())
    nodes = list(swarm.nodes.values())
    growth = rss_growth(nodes, args.warmup_s)
    totals = ledger.get("totals", {})
    ledger_tokens = totals.get("tokens", 0) + totals.get("unsigned_tokens", 0)
    return {
        "args": vars(args),
        "load_before": load,
        "load_after": os.getloadavg(),
        "seconds": round(swarm.now(), 1),
        "formed_after_s": tally.clients_from,
        "client_hours": round((ended - (tally.clients_from or 0.0)) / 3600, 3),
        "stopped_early_at_s": tally.stopped_early,
        "requests": len(tally.requests),
        "outcomes": dict(outcomes),
        "failed_why": dict(why),
        "failed_prefix_ok": all(r["prefix_ok"] for r in tally.requests if "prefix_ok" in r),
        "retried": dict(retried),
        "client_tokens": client_tokens,
        "ledger": ledger,
        "ledger_equals_clients": ledger_tokens == client_tokens,
        "tok_s_per_minute": per_minute(tally.tokens_at),
        "rss_growth_pct": growth,
        "rss_growth_max_pct": max(growth.values(), default=None),
        "fds_max": {n.name: max((f for _, _, f in n.samples), default=0) for n in nodes},
        "events": tally.events,
        "processes": [
            {
                "name": n.name,
                "role": n.role,
                "started": round(n.started, 1),
                "ended": n.ended,
                "exit": n.exit_code,
                "samples": n.samples,
            }
            for n in nodes
        ],
        "wrong": [r for r in tally.requests if r["outcome"] == "wrong"][:20],
        "failed": [r for r in tally.requests if r["outcome"] == "failed"][:50],
    }


async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from shard.trust.identity import NodeIdentity

    load = os.getloadavg()
    print(f"references (shard generate --local, {len(PROMPTS)} prompts)...", flush=True)
    want = await trio.to_thread.run_sync(references, args.model, args.max_tokens)
    NodeIdentity.generate().save(work / "coord.key")
    standby = ""
    if args.standby_coordinator:
        standby = (
            f'standby = "127.0.0.1:{args.port + 1}"\nstandby_api = "127.0.0.1:{args.port + 3}"\n'
        )
    spec = work / "soak.toml"
    spec.write_text(
        SPEC.format(
            model=args.model, coord=args.port, api=args.port + 2, standby=standby,
            expect=args.stages + args.standbys, stages=args.stages,
            dead_after=args.dead_after_s, sessions=max(16, args.clients * 2),
        )
    )  # fmt: skip
    apis = [f"http://127.0.0.1:{args.port + 2}"]
    if args.standby_coordinator:
        apis.append(f"http://127.0.0.1:{args.port + 3}")
    swarm = Swarm(work, spec, args)
    tally = Tally()
    try:
        swarm.coordinator()
        if args.standby_coordinator:
            swarm.standby_coordinator()
        for _ in range(args.stages + args.standbys):
            swarm.join()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler, swarm, args.sample_s)
            print("forming...", flush=True)
            await wait_ready(apis[0], args.form_timeout_s, swarm)
            args.model_id = await trio.to_thread.run_sync(model_id, apis[0])
            print(f"formed after {swarm.now():.0f} s; clients start", flush=True)
            nursery.start_soon(watch_ring, spec, tally, f"127.0.0.1:{args.port}")
            if args.standby_coordinator:  # the one that takes over: its feed from then on
                nursery.start_soon(watch_ring, spec, tally, f"127.0.0.1:{args.port + 1}")
            stop_at = swarm.now() + args.hours * 3600
            tally.clients_from = swarm.now()
            nursery.start_soon(stop_on_signal, swarm, tally)
            nursery.start_soon(churn, swarm, tally, args, stop_at)
            async with trio.open_nursery() as clients:
                for i in range(args.clients):
                    clients.start_soon(client, i, list(apis), want, args, tally, swarm, stop_at)
            nursery.cancel_scope.cancel()
        swarm.sample()
    finally:
        swarm.close()
    ledger = ledger_totals(work / "receipts", work / "coord.key")
    return summary(tally, swarm, ledger, args, load)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--stages", type=int, default=16, help="ring stages (default 16)")
    p.add_argument("--standbys", type=int, default=4, help="extra joiners at start")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--churn-s", type=float, default=180.0, help="seconds between events")
    p.add_argument("--dead-after-s", type=float, default=5.0)
    p.add_argument("--sample-s", type=float, default=30.0, help="RSS/fd sampling period")
    p.add_argument("--warmup-s", type=float, default=900.0, help="RSS growth measured after")
    p.add_argument("--form-timeout-s", type=float, default=1800.0)
    p.add_argument("--standby-coordinator", action="store_true")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--port", type=int, default=7870, help="coordinator; +1..+3 the others")
    p.add_argument("--seed", type=int, default=40)
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.json or HERE / "results" / f"soak-{time.strftime('%Y%m%dT%H%M%S')}.json"
    work = Path(tempfile.mkdtemp(prefix="shard-soak-"))
    print(f"work folder {work} (logs); results to {out}", flush=True)
    result = trio.run(soak, args, work)
    result["work"] = str(work)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    samples = [p["samples"] for p in result["processes"]]
    svg(result["tok_s_per_minute"], samples, out.with_suffix(".svg"))
    keys = ["seconds", "formed_after_s", "client_hours", "stopped_early_at_s", "requests"]
    keys += ["outcomes", "failed_why", "retried", "client_tokens"]
    keys += ["ledger_equals_clients", "rss_growth_max_pct", "load_before", "load_after"]
    for key in keys:
        print(f"{key}: {result[key]}")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

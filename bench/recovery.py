"""Failover recovery with real processes: how long a request stops when a stage dies.

Every run is a fresh swarm of processes (``shard.nodes.launcher.launch``) on free loopback ports: a
coordinator, ``--stages`` stage processes of the bundled SmolLM2 (fp32, ``layers = "auto"``,
plain decoding: ``[speculation] draft = "none"``, no emulated latency) and one ``[[standby]]``:

- ``hot``: the standby has ``layers_of = <victim>``: it holds the victim's block loaded;
- ``cold``: a spare (no ``layers_of``): it loads the block when the scheduler assigns it.

After one discarded warm-up request, the driver sends one ``--max-tokens`` request and, the
moment the client has received ``--fault-at`` tokens, sends the victim stage's process (the
middle stage ``s1`` by default):

- ``sigkill``: SIGKILL. The kernel closes its sockets at once; the coordinator's scheduler sees
  the control link close (detection ~ immediate);
- ``sigstop``: SIGSTOP. A frozen process keeps its sockets open; the scheduler declares it dead
  only after ``[failover] dead_after_s`` of heartbeat silence. It gets SIGCONT after the
  request (replaced and fenced out by then); the driver records what it does next.

The victim is gone after one fault, so a swarm serves exactly one faulted request; every
(scenario, prompt, repeat) gets its own swarm. A ``baseline`` swarm (hot standby, no fault)
runs every prompt first: its token ids are what every faulted run is compared with
(``identical``, reported, never asserted) and its token gaps are the undisturbed pace.

Per run the driver records the client-side arrival time of every streamed token batch and:

- ``interruption_s``: the longest gap between token arrivals that covers or follows the fault
  (what the client saw; the same measure as ``shard swarm run``'s "longest pause");
- ``detect_s``, ``splice_s``, ``total_s``: from the coordinator's log line
  ``scheduler: <standby> replaced <dead> (<hot|cold>) in <T> s (detected <D> s, spliced <S> s)``
  (the scheduler's clock: detection counts from the control link's close, or from the last
  heartbeat heard for a silent node);
- ``signal_to_dead_log_s``, ``signal_to_splice_log_s``: wall clock from the driver's signal to
  the log lines ``... is dead`` / ``... silent for`` and ``... replaced ...`` (asctime, ms
  resolution; same machine, same clock); ``resume_after_splice_s`` = ``interruption_s`` minus
  ``signal_to_splice_log_s``: from the splice to the next token (the standby's replay of the
  prompt and committed tokens, and the re-sent lap).

Writes JSON (``--json``), prints a Markdown table of medians per scenario. Benchmarks are not
tests: nothing here asserts a speed, and a failed recovery is recorded, not raised.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import trio

from plain_ring import Prompt, free_ports, git_info, machine_info
from shard.convert.bundled import resolve_model
from shard.messages import GenerateDone, GenerateRequest, TokensOut
from shard.nodes.launcher import SwarmHandle
from shard.spec.swarm import load_spec
from shard.transport import Network

REPO = Path(__file__).resolve().parent.parent
Record = dict[str, Any]
SCENARIOS = ("hot-sigkill", "hot-sigstop", "cold-sigkill", "cold-sigstop")
SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
STANDBY = "standby"
EXPECTATION = (
    "sigkill: detection ~ 0 (the control link closes with the process); sigstop: detection ~ "
    "dead_after_s after the last heartbeat heard (up to + heartbeat_s for the watchdog's tick). "
    "splice: activate the standby (cold: load the block first) + rewire its predecessor with "
    "replay (the standby rebuilds the KV of the prompt and the committed tokens). "
    "interruption ~ detection + splice + one ring lap (the re-sent step)."
)

# "2026-11-30 11:08:15,123 shard.failover.scheduler WARNING scheduler: ..." (shard.cli's
# format)
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) (\w+) (.*)$")
_REPLACED = re.compile(
    r"scheduler: (\S+) replaced (\S+) \((\w+)\) in ([0-9.]+) s "
    r"\(detected ([0-9.]+) s, spliced ([0-9.]+) s\)"
)
_DEAD = re.compile(r"scheduler: (\S+) (?:is dead \((.*)\)|silent for ([0-9.]+) s: dead)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/recovery.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (the default run, ~6-8 min on a loaded 2-core machine): "
        ".venv/bin/python bench/recovery.py",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument(
        "--fault-at",
        type=int,
        default=16,
        help="signal the victim once the client has received this many tokens (default 16)",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, from {', '.join(SCENARIOS)} (default: all four)",
    )
    p.add_argument(
        "--prompts",
        default="02-code,03-prose,04-chat",
        help="comma-separated prompt names (file stems) in --prompt-dir "
        "(default 02-code,03-prose,04-chat; 'all' = every *.txt)",
    )
    p.add_argument(
        "--prompt-dir",
        type=Path,
        default=REPO / "bench/prompts",
        help="dir of *.txt prompts (default bench/prompts)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="faulted runs per (scenario, prompt), each on a fresh swarm (default 1)",
    )
    p.add_argument("--stages", type=int, default=3, help="stage processes (default 3)")
    p.add_argument("--victim", default="s1", help="the stage to kill or stop (default s1)")
    p.add_argument(
        "--heartbeat-s", type=float, default=0.25, help="[failover] heartbeat_s (default 0.25)"
    )
    p.add_argument(
        "--dead-after-s", type=float, default=1.0, help="[failover] dead_after_s (default 1.0)"
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="[limits] connect_timeout_s (default 10, as specs/failover.toml); it also bounds "
        "a WebSocket close handshake, which a frozen peer never answers",
    )
    p.add_argument(
        "--linger-s",
        type=float,
        default=3.0,
        help="sigstop: after SIGCONT, watch the old process this long before tearing the swarm "
        "down (default 3)",
    )
    p.add_argument(
        "--model", default="smollm2", help="bundled name or checkpoint dir (default smollm2)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench/results/recovery.json",
        help="output file (default bench/results/recovery.json)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    return p.parse_args(argv)


# -- spec ------------------------------------------------------------------------------------


def spec_toml(
    name: str, ports: Sequence[int], stages: int, standby: str, victim: str, args: Any
) -> str:
    """Coordinator, ``stages`` stages (auto layers), one standby (``hot``: ``layers_of =
    victim``; ``cold``: a spare), ``[failover]`` timings from ``args``, plain decoding."""
    lines = [
        "[swarm]",
        f'name = "{name}"',
        'model = "smollm2"',
        'dtype = "float32"',
        "insecure = true",
        "",
        "[limits]",
        "max_sessions = 16\nmax_len = 2048\nprefill_chunk = 128",
        f"max_message_mib = 64\nconnect_timeout_s = {args.connect_timeout_s:g}",
        "",
        "[coordinator]",
        'name = "coord"',
        f'listen = "127.0.0.1:{ports[0]}"',
    ]
    for i in range(stages):
        lines += ["", "[[stage]]", f'name = "s{i}"', f'listen = "127.0.0.1:{ports[1 + i]}"']
        lines += ['layers = "auto"']
    lines += ["", "[[standby]]", f'name = "{STANDBY}"', f'listen = "127.0.0.1:{ports[-1]}"']
    if standby == "hot":
        lines += [f'layers_of = "{victim}"']
    lines += ["", "[failover]", f"heartbeat_s = {args.heartbeat_s:g}"]
    lines += [f"dead_after_s = {args.dead_after_s:g}"]
    lines += ["", "[speculation]", 'draft = "none"  # plain decoding: one token per lap', ""]
    return "\n".join(lines)


# -- one swarm -------------------------------------------------------------------------------


@attrs.define
class Stream:
    """One request's streamed tokens: when each batch arrived (trio clock), and the fault."""

    started: float
    fault_at: int | None = None
    on_fault: Callable[[], None] | None = None  # called once ``fault_at`` tokens arrived
    tokens: int = 0
    arrivals: list[tuple[float, int]] = attrs.field(factory=list)
    fired: float | None = None  # trio clock at the signal
    fired_wall: float | None = None  # time.time() at the signal
    fired_tokens: int | None = None

    def add(self, out: TokensOut) -> None:
        now = trio.current_time()
        self.tokens += len(out.token_ids)
        self.arrivals.append((now, len(out.token_ids)))
        if self.fault_at is not None and self.fired is None and self.tokens >= self.fault_at:
            self.fired, self.fired_wall, self.fired_tokens = now, time.time(), self.tokens
            if self.on_fault is not None:
                self.on_fault()

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between arrivals; the first from the request's start."""
        times = [self.started, *(t for t, _ in self.arrivals)]
        return list(itertools.pairwise(times))

    def timing(self) -> Record:
        gaps = self.gaps()[1:]  # decode only: the first gap is the prefill
        lengths = [b - a for a, b in gaps]
        out: Record = {
            "first_token_s": self.arrivals[0][0] - self.started if self.arrivals else None,
            "seconds": self.arrivals[-1][0] - self.started if self.arrivals else None,
            "batches": len(self.arrivals),
            "arrivals_s": [round(t - self.started, 4) for t, _ in self.arrivals],
            "batch_tokens": [n for _, n in self.arrivals],
            "median_gap_s": statistics.median(lengths) if lengths else None,
            "max_gap_s": max(lengths, default=None),
        }
        if self.fired is not None:
            at = self.fired
            after = [b - a for a, b in self.gaps() if b >= at]
            covering = [b - a for a, b in self.gaps() if a <= at < b]
            before = [b - a for a, b in gaps if b <= at]
            following = [b - a for a, b in gaps if a > at]
            longest = max(after, default=0.0)
            resumed = next((i for i, d in enumerate(following) if d == longest), None)
            out.update(
                fault_after_s=at - self.started,
                fault_tokens=self.fired_tokens,
                interruption_s=longest,
                gap_covering_fault_s=covering[0] if covering else None,
                median_gap_before_fault_s=statistics.median(before) if before else None,
                # gaps after the interruption: the pace with the standby in the ring
                median_gap_after_recovery_s=_median_or_none(
                    following[resumed + 1 :] if resumed is not None else following[1:]
                ),
                tokens_after_fault=self.tokens - (self.fired_tokens or 0),
            )
        return out


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


class LauncherLog(logging.Handler):
    """Keeps the launcher's own log records (``shard.nodes.launcher``: e.g. an expected exit's
    code)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


async def ask(
    network: Network,
    handle: SwarmHandle,
    prompt: Prompt,
    max_tokens: int,
    stream: Stream | None,
    *,
    rid: int,
    timeout_s: float,
) -> GenerateDone:
    from shard.coordinator.client import request

    req = GenerateRequest(rid, prompt.text, max_tokens, chat=prompt.chat, k=0)  # k=0: plain
    with trio.fail_after(timeout_s):
        return await request(
            network,
            handle.coordinator,
            req,
            swarm=handle.swarm,
            on_text=stream.add if stream is not None else None,
        )


def _open_log(path: Path) -> BinaryIO:
    """The swarm's stderr (every node's log), appended to; one file per swarm."""
    return open(path, "ab")


def _process_state(pid: int) -> str:
    """'R', 'S', 'T' (stopped), 'Z' (exited, not yet reaped), ... or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


async def run_swarm(
    model_dir: Path,
    workdir: Path,
    tag: str,
    standby: str,
    jobs: Sequence[tuple[Prompt, str | None]],
    args: argparse.Namespace,
    launcher_log: LauncherLog,
) -> Record:
    """Launch a fresh swarm, warm it up, run ``jobs`` (prompt, fault or None) in order, stop it.

    A fault stops the victim for good, so it must be the last job. Errors of the swarm (a node
    that exits unexpectedly, a request that times out) end the swarm and are recorded."""
    from shard.nodes.launcher import launch
    from shard.transport import WebSocketNetwork

    spec_path = workdir / f"{tag}.toml"
    log_path = workdir / f"{tag}.log"
    name = f"bench-recovery-{tag}".replace(".", "_")
    spec_path.write_text(
        spec_toml(name, free_ports(args.stages + 2), args.stages, standby, args.victim, args)
    )
    spec = load_spec(spec_path)
    swarm: Record = {"tag": tag, "standby": standby, "spec": spec_path.read_text()}
    runs: list[Record] = []
    rids = itertools.count(1)
    launcher_log.lines.clear()
    began = trio.current_time()
    try:
        with _open_log(log_path) as log_file:
            async with trio.open_nursery() as nursery:
                handle: SwarmHandle = await nursery.start(
                    lambda task_status: launch(
                        spec_path,
                        spec,
                        model_dir=model_dir,
                        stderr=log_file,
                        task_status=task_status,
                    )
                )
                swarm["startup_s"] = trio.current_time() - began
                swarm["pids"] = dict(handle.pids)
                _progress(f"{tag}: up in {swarm['startup_s']:.1f} s")
                async with WebSocketNetwork() as network:
                    timeout_s = args.request_timeout
                    warm = await ask(
                        network, handle, jobs[0][0], 4, None, rid=next(rids), timeout_s=timeout_s
                    )
                    swarm["warmup_finish_reason"] = warm.finish_reason
                    for prompt, fault in jobs:
                        run = await _one_request(network, handle, prompt, fault, next(rids), args)
                        runs.append(run)
                nursery.cancel_scope.cancel()
    except Exception as exc:  # recorded, not raised: a benchmark reports what happened
        swarm["error"] = _describe(exc)
        _progress(f"{tag}: swarm error: {swarm['error']}")
    swarm["wall_s"] = trio.current_time() - began
    swarm["launcher_log"] = list(launcher_log.lines)
    lines = _read_log(log_path)
    swarm["log_lines"] = len(lines)
    for run in runs:
        if run.get("fault") is not None:
            run.update(_recovery_from_log(lines, run.get("signal_wall")))
            if run.get("interruption_s") is not None and "signal_to_splice_log_s" in run:
                # from the splice's log line to the next token: replay + the re-sent lap
                run["resume_after_splice_s"] = run["interruption_s"] - run["signal_to_splice_log_s"]
            run["log"] = [ln["text"] for ln in lines][-60:]  # the tail: the fault is last
    if "error" in swarm and not runs:
        swarm["log"] = [ln["text"] for ln in lines][-60:]
    swarm["runs"] = runs
    return swarm


async def _one_request(
    network: Network,
    handle: SwarmHandle,
    prompt: Prompt,
    fault: str | None,
    rid: int,
    args: argparse.Namespace,
) -> Record:
    victim = args.victim
    pid = handle.pids[victim]

    def fire() -> None:
        assert fault is not None
        if fault == "sigkill":
            handle.expect_exit(victim)  # a scripted death: logged as such
        os.kill(pid, SIGNALS[fault])

    stream = Stream(trio.current_time(), fault_at=args.fault_at if fault else None, on_fault=fire)
    run: Record = {"prompt": prompt.name, "chat": prompt.chat, "fault": fault}
    run["victim"] = victim if fault else None
    run["loadavg_1min_before"] = os.getloadavg()[0]
    try:
        done = await ask(
            network,
            handle,
            prompt,
            args.max_tokens,
            stream,
            rid=rid,
            timeout_s=args.request_timeout,
        )
        run.update(
            token_ids=list(done.token_ids),
            text=done.text,
            finish_reason=done.finish_reason,
            error=done.error or None,
            tokens=done.stats.tokens,
            request_seconds=done.stats.seconds,
            mean_lap_s=done.stats.mean_lap_s,
            laps=done.stats.laps,
        )
    except Exception as exc:
        run.update(token_ids=None, finish_reason="exception", error=_describe(exc))
    run.update(stream.timing())
    run["fired"] = stream.fired is not None
    run["signal_wall"] = stream.fired_wall
    if fault == "sigstop" and stream.fired is not None:
        # Replaced and fenced out by now (or the recovery failed): wake it and watch it.
        handle.expect_exit(victim)
        os.kill(pid, signal.SIGCONT)
        run["victim_after_sigcont"] = await _watch_victim(pid, args.linger_s)
    elif fault == "sigkill" and stream.fired is not None:
        run["victim_after_sigkill"] = _process_state(pid)
    run["loadavg_1min_after"] = os.getloadavg()[0]
    return run


async def _watch_victim(pid: int, linger_s: float) -> Record:
    """After SIGCONT: does the old process leave by itself within ``linger_s``?"""
    began = trio.current_time()
    while trio.current_time() - began < linger_s:
        state = _process_state(pid)
        if state in ("Z", "gone"):
            return {"exited": True, "after_s": trio.current_time() - began, "state": state}
        await trio.sleep(0.05)
    return {"exited": False, "after_s": linger_s, "state": _process_state(pid)}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


# -- the log ----------------------------------------------------------------------------------


def _read_log(path: Path) -> list[Record]:
    """Every line of the swarm's stderr; lines in shard's log format get a wall-clock time."""
    out: list[Record] = []
    if not path.exists():
        return out
    for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _LOG_LINE.match(text)
        wall = None
        if m is not None:
            stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            wall = stamp.timestamp()  # asctime is local time, as time.time() is read here
        out.append({"text": text, "wall": wall, "message": m.group(4) if m else text})
    return out


def _recovery_from_log(lines: Sequence[Record], signal_wall: float | None) -> Record:
    """The scheduler's 'is dead' and 'replaced' lines after the signal, parsed."""
    out: Record = {"recovered": False, "recovery": None, "dead_line": None}
    for ln in lines:
        if signal_wall is not None and ln["wall"] is not None and ln["wall"] < signal_wall - 1:
            continue  # before the fault (asctime is truncated to ms: keep a margin)
        dead = _DEAD.search(ln["message"])
        if dead is not None and out["dead_line"] is None:
            out["dead_line"] = ln["message"]
            if signal_wall is not None and ln["wall"] is not None:
                out["signal_to_dead_log_s"] = ln["wall"] - signal_wall
        m = _REPLACED.search(ln["message"])
        if m is not None and out["recovery"] is None:
            standby, dead_node, kind, total, detect, splice = m.groups()
            out["recovered"] = True
            out["recovery"] = {
                "line": ln["message"],
                "standby": standby,
                "dead": dead_node,
                "kind": kind,
                "total_s": float(total),
                "detect_s": float(detect),
                "splice_s": float(splice),
            }
            out.update(detect_s=float(detect), splice_s=float(splice), total_s=float(total))
            if signal_wall is not None and ln["wall"] is not None:
                out["signal_to_splice_log_s"] = ln["wall"] - signal_wall
    out["problem_lines"] = [
        ln["message"]
        for ln in lines
        if (signal_wall is None or ln["wall"] is None or ln["wall"] >= signal_wall - 1)
        and re.search(r"\b(ERROR|CRITICAL|Traceback)\b|failed|could not be repaired", ln["text"])
    ][:40]
    return out


# -- the run -----------------------------------------------------------------------------------


async def run_all(
    model_dir: Path,
    prompts: Sequence[Prompt],
    scenarios: Sequence[str],
    args: argparse.Namespace,
    workdir: Path,
    launcher_log: LauncherLog,
) -> list[Record]:
    """The baseline swarm (every prompt x repeats, no fault), then every faulted run on its own
    swarm, interleaved: per repeat, per prompt, each scenario, so load drift hits all alike."""
    swarms = []
    jobs: list[tuple[Prompt, str | None]] = [
        (p, None) for _ in range(args.repeats) for p in prompts
    ]
    swarms.append(
        {
            "scenario": "baseline",
            **await run_swarm(model_dir, workdir, "baseline", "hot", jobs, args, launcher_log),
        }
    )
    for rep in range(args.repeats):
        for prompt in prompts:
            for scenario in scenarios:
                standby, fault = scenario.split("-")
                tag = f"{scenario}-{prompt.name}-r{rep}"
                swarm = await run_swarm(
                    model_dir, workdir, tag, standby, [(prompt, fault)], args, launcher_log
                )
                swarms.append({"scenario": scenario, "repeat": rep, **swarm})
                for r in swarm["runs"]:
                    _progress(
                        f"{tag}: recovered {r.get('recovered')} "
                        f"detect {_fmt(r.get('detect_s'))} splice {_fmt(r.get('splice_s'))} "
                        f"total {_fmt(r.get('total_s'))} interruption "
                        f"{_fmt(r.get('interruption_s'))} s"
                    )
    return swarms


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


# -- summary -----------------------------------------------------------------------------------


def summarize(swarms: Sequence[Record], scenarios: Sequence[str]) -> list[Record]:
    """Per scenario: medians over its runs; ``identical`` against the baseline's ids."""
    baseline = [r for s in swarms if s["scenario"] == "baseline" for r in s["runs"]]
    reference: dict[str, list[int]] = {}
    for r in baseline:
        if r.get("token_ids") is not None:
            reference.setdefault(r["prompt"], r["token_ids"])
    rows = []
    for scenario in ("baseline", *scenarios):
        group = [s for s in swarms if s["scenario"] == scenario]
        runs = [r for s in group for r in s["runs"]]
        for r in runs:
            ref = reference.get(r["prompt"])
            r["identical"] = None if ref is None else r.get("token_ids") == ref
            if r["identical"] is False and r.get("token_ids") is not None and ref is not None:
                ids = r["token_ids"]
                r["first_difference"] = next(
                    (i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                    min(len(ids), len(ref)),
                )
        row: Record = {"scenario": scenario, "runs": len(runs), "swarms": len(group)}
        row["swarm_errors"] = sum("error" in s for s in group)
        row["median_startup_s"] = _median([s for s in group], "startup_s")
        if scenario == "baseline":
            row["median_gap_s"] = _median(runs, "median_gap_s")
            row["median_max_gap_s"] = _median(runs, "max_gap_s")
        else:
            row["fired"] = sum(bool(r.get("fired")) for r in runs)
            row["recovered"] = sum(bool(r.get("recovered")) for r in runs)
            kinds = sorted({r["recovery"]["kind"] for r in runs if r.get("recovery")})
            row["kinds"] = kinds
            for key in (
                "detect_s",
                "splice_s",
                "total_s",
                "interruption_s",
                "gap_covering_fault_s",
                "signal_to_dead_log_s",
                "signal_to_splice_log_s",
                "resume_after_splice_s",
                "median_gap_before_fault_s",
                "median_gap_after_recovery_s",
            ):
                row[f"median_{key}"] = _median(runs, key)
            row["min_interruption_s"] = min(
                (r["interruption_s"] for r in runs if r.get("interruption_s") is not None),
                default=None,
            )
            woken = [r["victim_after_sigcont"] for r in runs if r.get("victim_after_sigcont")]
            if woken:
                exited = sum(w["exited"] for w in woken)
                row["victim_exited_after_sigcont"] = f"{exited}/{len(woken)}"
            row["max_interruption_s"] = max(
                (r["interruption_s"] for r in runs if r.get("interruption_s") is not None),
                default=None,
            )
        row["finish_reasons"] = sorted({str(r.get("finish_reason")) for r in runs})
        ident = [r["identical"] for r in runs if r["identical"] is not None]
        row["identical"] = f"{sum(ident)}/{len(runs)}"
        rows.append(row)
    return rows


def _median(records: Sequence[Record], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(rows: Sequence[Record]) -> str:
    """The summary as Markdown: medians over runs, seconds."""

    def s(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    out = [
        "| scenario | runs | recovered | detect_s | splice_s | total_s | signal→splice log | "
        "interruption_s | median gap | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["scenario"] == "baseline":
            out.append(
                f"| baseline (no fault) | {r['runs']} | – | – | – | – | – | "
                f"{s(r['median_max_gap_s'])} (max gap) | {s(r['median_gap_s'])} | "
                f"{r['identical']} |"
            )
            continue
        out.append(
            f"| {r['scenario']} | {r['runs']} | {r['recovered']}/{r['runs']} | "
            f"{s(r['median_detect_s'])} | {s(r['median_splice_s'])} | "
            f"{s(r['median_total_s'])} | {s(r['median_signal_to_splice_log_s'])} | "
            f"{s(r['median_interruption_s'])} | {s(r['median_median_gap_before_fault_s'])} | "
            f"{r['identical']} |"
        )
    return "\n".join(out)


def _progress(line: str) -> None:
    print(f"[recovery] {line}", file=sys.stderr, flush=True)


def _select_prompts(args: argparse.Namespace) -> list[Prompt]:
    files = sorted(args.prompt_dir.glob("*.txt"))
    if args.prompts != "all":
        wanted = [x.strip() for x in args.prompts.split(",") if x.strip()]
        by_name = {f.stem: f for f in files}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            raise SystemExit(f"recovery: no prompt {missing} in {args.prompt_dir}")
        files = [by_name[w] for w in wanted]
    return [Prompt.from_file(f) for f in files]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    unknown = [x for x in scenarios if x not in SCENARIOS]
    if unknown:
        print(f"recovery: unknown scenario {unknown}; choose from {SCENARIOS}", file=sys.stderr)
        return 2
    if args.victim not in {f"s{i}" for i in range(args.stages)}:
        print(f"recovery: --victim must be one of s0..s{args.stages - 1}", file=sys.stderr)
        return 2
    prompts = _select_prompts(args)
    model_dir = resolve_model(args.model)
    launcher_log = LauncherLog()
    logging.getLogger("shard.nodes.launcher").addHandler(launcher_log)
    logging.getLogger("shard.nodes.launcher").setLevel(logging.INFO)
    began = time.perf_counter()
    load_start = os.getloadavg()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="shard-recovery-") as tmp:
        workdir = Path(tmp)
        swarms = trio.run(run_all, model_dir, prompts, scenarios, args, workdir, launcher_log)
    rows = summarize(swarms, scenarios)
    result = {
        "benchmark": "recovery",
        "date": date,
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "wall_s": time.perf_counter() - began,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "git": git_info(),
        "machine": machine,
        "config": _config(args, prompts, scenarios),
        "expectation": EXPECTATION,
        "summary": rows,
        "swarms": swarms,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(table(rows))
    print(f"\nwrote {args.json} ({result['wall_s']:.0f} s)", file=sys.stderr)
    return 0


def _config(args: argparse.Namespace, prompts: list[Prompt], scenarios: list[str]) -> Record:
    nodes = args.stages + 2  # stages, the coordinator, the standby
    return {
        "model": args.model,
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "fault_at_tokens": args.fault_at,
        "stages": args.stages,
        "victim": args.victim,
        "scenarios": scenarios,
        "prompts": [p.name for p in prompts],
        "repeats": args.repeats,
        "failover": {"heartbeat_s": args.heartbeat_s, "dead_after_s": args.dead_after_s},
        "connect_timeout_s": args.connect_timeout_s,
        "sampling": "greedy (temperature 0), plain decoding (k = 0, draft none)",
        "latency_ms": 0,
        # what shard.nodes.launcher.launch passes each node as ``shard up --threads``
        "threads_per_node": max(1, (os.cpu_count() or 1) // nodes),
        "baseline": "one swarm with the hot standby, no fault, every prompt x repeats",
        "order": "baseline first; then per repeat, per prompt, each scenario on a fresh swarm; "
        "one discarded 4-token warm-up request per swarm",
        "linger_s": args.linger_s,
    }


if __name__ == "__main__":
    sys.exit(main())

"""Real processes in tests: free loopback ports, spec files, and bounded runs that clean up.

Every process started here runs in a session of its own (``start_new_session=True``), so its
process group id is its PID, and this test process is a child subreaper
(``PR_SET_CHILD_SUBREAPER``): a process whose parent exits is re-parented to us, not to init.
So whatever a CLI run leaves behind — in its group, or in sessions of their own like the swarm
nodes ``shard swarm up|run`` starts — is found (``stragglers``, ``orphans()``), and on every way
out (success, failure, timeout, cancellation) the helpers kill it by PID and reap it; a test
never leaves processes behind. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import trio

#: How a test runs the CLI: the interpreter running the tests, so the same venv and sources.
SHARD = (sys.executable, "-m", "shard")
LOOPBACK = "127.0.0.1"
#: How long a killed process group gets to be reaped before we stop waiting.
_REAP_S = 10.0
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
#: PIDs of the processes these helpers started (ours to wait for, through Trio); any other
#: child of this process is an orphan re-parented to us.
_STARTED: set[int] = set()
#: One entry per start in flight: the children this process had when it began. Trio runs
#: ``Popen`` in a worker thread, so other tasks run between the fork and ``_STARTED.add``; a
#: child born since a start began may be that start's own, not an orphan, and is left alone
#: (neither killed nor reaped) until the start is registered.
_SPAWNING: list[frozenset[int]] = []


def child_env() -> dict[str, str]:
    """The environment of every process started here: ours, with one torch thread each.

    A swarm is several processes on few cores; torch's default of one intra-op thread per core
    then oversubscribes them, and its spinning threads thrash (SmolLM2 decoded 9x slower on a
    busy 2-core machine). Every process — nodes and the local reference alike — gets the same
    setting, so outputs stay comparable.
    """
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


#: How many ports below the kernel's ephemeral range ``free_ports`` draws from.
PORT_SPAN = 12000


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (32768 if unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1, bound together, then released.

    Drawn below the kernel's ephemeral range: a port the kernel picked there (port 0) could be
    handed to an outgoing connection of the test's own nodes between this release and a
    node's bind ("port ... is already in use": ``test_batch_swarm`` failed so once, session
    34). Ports below the range are only ever taken by a bind."""
    top = _ephemeral_low()
    pick = random.Random()
    socks: list[socket.socket] = []
    try:
        for _ in range(50 * n):
            if len(socks) == n:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((LOOPBACK, pick.randrange(max(1024, top - PORT_SPAN), top)))
            except OSError:  # taken (or one of ours): draw again
                sock.close()
                continue
            socks.append(sock)
        while len(socks) < n:  # that span is full: let the kernel choose, as before
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def write_spec(
    path: Path,
    *,
    model_dir: Path,
    blocks: Sequence[tuple[int, int]],
    name: str = "test",
    latency_ms: float = 0.0,
    limits: dict[str, int | float] | None = None,
) -> Path:
    """Write a TOML spec: coordinator ``coord`` and stages ``s0..`` holding ``blocks``, each
    listening on a free loopback port. Returns ``path``."""
    ports = free_ports(len(blocks) + 1)
    lines = [
        "[swarm]",
        f"name = {json.dumps(name)}",
        f"model = {json.dumps(str(model_dir))}",
        "insecure = true",
        "",
        "[limits]",
        *(f"{key} = {value!r}" for key, value in (limits or {}).items()),
        "",
        "[coordinator]",
        'name = "coord"',
        f'listen = "{LOOPBACK}:{ports[0]}"',
    ]
    for i, (first, last) in enumerate(blocks):
        lines += ["", "[[stage]]", f'name = "s{i}"', f'listen = "{LOOPBACK}:{ports[i + 1]}"']
        lines.append(f"layers = [{first}, {last}]")
    if latency_ms:
        lines += ["", "[links]", f"latency_ms = {float(latency_ms)!r}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@attrs.frozen
class Finished:
    """A finished CLI run: exit code, output, and the processes of its group that outlived it."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    stragglers: tuple[int, ...]

    def json_records(self) -> list[dict[str, Any]]:
        """One parsed object per non-empty stdout line (``--json`` output)."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def describe(self) -> str:
        """For assertion messages: the command, its exit code and the tail of its stderr."""
        command = " ".join(self.args)
        return f"`{command}` exited {self.returncode}; stderr:\n{self.stderr[-3000:]}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgrp)`` of a process from /proc, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp ...
    return fields[0], int(fields[1]), int(fields[2])


def _processes() -> list[tuple[int, tuple[str, int, int]]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                found.append((int(entry.name), stat))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes in process group ``pgid``."""
    return [pid for pid, (state, _, pgrp) in _processes() if pgrp == pgid and state != "Z"]


def become_subreaper() -> None:
    """Make this process the one orphans of its descendants are re-parented to (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def orphans() -> list[int]:
    """Live processes that outlived the parent that started them (re-parented to us); reaps
    the dead ones."""
    me, found = os.getpid(), []
    for pid, (state, ppid, _) in _processes():
        if ppid != me or pid in _STARTED or any(pid not in had for had in _SPAWNING):
            continue
        if state == "Z":
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        else:
            found.append(pid)
    return found


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a session leader's PID); gone already is fine."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def kill_orphans() -> None:
    """SIGKILL every orphan re-parented to us, by PID, and reap it."""
    for pid in orphans():
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with suppress(ChildProcessError):
            os.waitpid(pid, 0)


async def _open(cmd: list[str], **options: Any) -> trio.Process:
    """Start ``cmd`` in a session of its own, with ``child_env()``; tracked for ``orphans``."""
    become_subreaper()
    me = os.getpid()
    had = frozenset(pid for pid, (_, ppid, _) in _processes() if ppid == me)
    _SPAWNING.append(had)
    try:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env(), **options
        )
        _STARTED.add(proc.pid)
    finally:
        _SPAWNING.remove(had)
    return proc


async def _reap(proc: trio.Process) -> None:
    kill_group(proc.pid)
    with trio.CancelScope(shield=True), trio.move_on_after(_REAP_S):
        await proc.wait()
    _STARTED.discard(proc.pid)
    kill_orphans()  # the children of a launcher we just killed


async def _drain(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
    assert stream is not None
    async for chunk in stream:
        into += chunk


async def run_shard(*args: str, timeout_s: float, prefix: Sequence[str] = ()) -> Finished:
    """Run ``shard ARGS`` to completion within ``timeout_s`` (else ``AssertionError``).

    Records which processes of its group were still alive when it exited (``stragglers``),
    then kills the group, so an orphan is reported rather than left running. ``prefix`` runs
    it through another command that execs it (``ip netns exec NS``: same PID).
    """
    return await _run([*prefix, *SHARD, *args], ("shard", *args), timeout_s)


async def run_python(code: str, *args: str, timeout_s: float) -> Finished:
    """Run ``python -c CODE ARGS`` like ``run_shard`` (same interpreter, same cleanup)."""
    return await _run([sys.executable, "-c", code, *args], ("python -c ...", *args), timeout_s)


async def _run(cmd: list[str], args: tuple[str, ...], timeout_s: float) -> Finished:
    out, err = bytearray(), bytearray()
    stragglers: list[int] = []
    proc = await _open(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with trio.move_on_after(timeout_s) as waited:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, proc.stdout, out)
                nursery.start_soon(_drain, proc.stderr, err)
                await proc.wait()
                stragglers = group_members(proc.pid) + orphans()
                kill_group(proc.pid)  # a straggler holding our pipes would stall the drains
                kill_orphans()
    finally:
        await _reap(proc)
    if waited.cancelled_caught:
        raise AssertionError(
            f"`{' '.join(args)}` still running after {timeout_s:g} s; killed. "
            f"stderr:\n{err.decode(errors='replace')[-3000:]}"
        )
    assert proc.returncode is not None
    return Finished(
        args=args,
        returncode=proc.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        stragglers=tuple(stragglers),
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _log_file(path: Path) -> BinaryIO:
    return path.open("wb")


@asynccontextmanager
async def started_shard(
    *args: str,
    stderr_path: Path,
    background: bool = False,
    prefix: Sequence[str] = (),
    program: Sequence[str] = SHARD,
) -> AsyncIterator[trio.Process]:
    """Start ``shard ARGS`` (stdout piped, stderr to ``stderr_path``) for the body; on the way
    out, whatever happened, kill its whole process group and every orphan, and reap them.

    ``background``: start it as a shell starts ``shard ARGS &``, with SIGINT ignored.
    ``prefix``: a command that execs it (``ip netns exec NS``: the PID stays the same).
    ``program``: what runs ``ARGS`` instead of ``python -m shard`` (a test-only entry point).
    """
    options: dict[str, Any] = {"preexec_fn": _ignore_sigint} if background else {}
    cmd = [*prefix, *program, *args]
    with _log_file(stderr_path) as stderr:
        proc = await _open(cmd, stdout=subprocess.PIPE, stderr=stderr, **options)
    try:
        yield proc
    finally:
        await _reap(proc)


@asynccontextmanager
async def started_python(code: str, *args: str) -> AsyncIterator[trio.Process]:
    """Start ``python -c CODE ARGS`` (stdout piped) for the body, cleaned up as
    ``started_shard`` does."""
    proc = await _open([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    try:
        yield proc
    finally:
        await _reap(proc)


class LineReader:
    """Reads a process's stdout line by line (the caller bounds each read with a deadline);
    ``log``: the process's stderr file, whose tail an ``EOFError`` carries (why it ended)."""

    def __init__(self, stream: trio.abc.ReceiveStream | None, log: Path | None = None) -> None:
        assert stream is not None
        self._stream = stream
        self._log = log
        self._buffer = b""
        self.seen: list[str] = []

    async def line_starting(self, prefix: str) -> str:
        """The next line starting with ``prefix``. Errors: ``EOFError`` if stdout ends first."""
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                line = raw.decode(errors="replace").rstrip("\r")
                self.seen.append(line)
                if line.startswith(prefix):
                    return line
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                why = "" if self._log is None else "\n" + self._log.read_text()[-6000:]
                raise EOFError(f"stdout ended before a {prefix!r} line; saw {self.seen[-5:]}{why}")
            self._buffer += chunk


async def wait_gone(pids: Sequence[int], *, timeout_s: float) -> list[int]:
    """Wait until every process in ``pids`` has exited (ours or not: through its pidfd); returns
    those still running after ``timeout_s``."""
    fds = {}
    for pid in pids:
        with suppress(ProcessLookupError):
            fds[pid] = os.pidfd_open(pid)
    try:
        with trio.move_on_after(timeout_s):
            for fd in fds.values():
                await trio.lowlevel.wait_readable(fd)
        return [pid for pid in pids if alive(pid)]
    finally:
        for fd in fds.values():
            os.close(fd)

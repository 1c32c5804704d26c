"""The ring as real processes: ``shard swarm run|up`` and ``shard generate --spec`` over
WebSockets on loopback, compared token for token with ``shard generate --local``.

Charter: 127.0.0.1 only, free ports found by binding port 0; every process runs in its own
session and is killed with its whole group by PID on every way out (``tests/procs.py``);
every run is bounded. Output is compared exactly; timings are checked only as lower bounds
that prove a relay delayed (never as speed).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from procs import (
    LineReader,
    alive,
    group_members,
    orphans,
    run_python,
    run_shard,
    started_shard,
    wait_gone,
    write_spec,
)

pytestmark = pytest.mark.slow

PROMPTS = ("The capital of France is", "Hello, world! Hello", "in the beginning the river")
MAX_TOKENS = 16
#: KV length for tiny checkpoints (their max_position_embeddings is 512); spec and --local agree.
MAX_LEN = 256
TINY_LIMITS = {"max_len": MAX_LEN, "connect_timeout_s": 5.0}
RUN_S = 120.0  # bound on one `swarm run` (process starts + torch imports on 2 cores)


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=3, n_layers=4)


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=4, arch="qwen2", n_layers=5)


#: ``shard generate --local --json`` once per prompt (argv after ``-c``), in one interpreter: the
#: CLI's own entry point and output, without paying a torch import per prompt.
_LOCAL_SCRIPT = """
import sys
from shard.cli import main
model, max_tokens, max_len, *prompts = sys.argv[1:]
for prompt in prompts:
    argv = ["generate", "--local", "--json", "--model", model, "--max-tokens", max_tokens]
    code = main([*argv, "--max-len", max_len, prompt])
    if code != 0:
        sys.exit(code)
"""

Key = tuple[Path, str, int, int]


class LocalReferences:
    """The single-process reference (``generate --local --json``) per prompt, memoized for
    the module: several tests compare against the same prompts."""

    def __init__(self) -> None:
        self._done: dict[Key, dict[str, Any]] = {}

    async def get(
        self, model_dir: Path, prompts: Sequence[str], *, max_tokens: int, max_len: int
    ) -> list[dict[str, Any]]:
        keys = [(model_dir, p, max_tokens, max_len) for p in prompts]
        missing = [k[1] for k in dict.fromkeys(keys) if k not in self._done]
        if missing:
            args = (str(model_dir), str(max_tokens), str(max_len), *missing)
            done = await run_python(_LOCAL_SCRIPT, *args, timeout_s=RUN_S)
            assert done.returncode == 0, done.describe()
            records = done.json_records()
            assert len(records) == len(missing), done.describe()
            for prompt, record in zip(missing, records, strict=True):
                self._done[(model_dir, prompt, max_tokens, max_len)] = record
        return [self._done[k] for k in keys]


@pytest.fixture(scope="module")
def references() -> LocalReferences:
    return LocalReferences()


async def swarm_run_vs_local(
    references: LocalReferences,
    spec: Path,
    model_dir: Path,
    prompts: Sequence[str],
    tmp_path: Path,
    *,
    max_tokens: int = MAX_TOKENS,
    max_len: int = MAX_LEN,
) -> list[dict[str, Any]]:
    """Run ``swarm run --json --prompts`` and the local reference of every prompt side by
    side; assert the token ids match and that no process outlived the launcher."""
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    refs: list[dict[str, Any]] = []

    async def reference() -> None:
        refs.extend(
            await references.get(model_dir, prompts, max_tokens=max_tokens, max_len=max_len)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reference)
        done = await run_shard(
            "swarm",
            "run",
            str(spec),
            "--json",
            "--prompts",
            str(prompts_file),
            "--max-tokens",
            str(max_tokens),
            "--model",
            str(model_dir),
            timeout_s=RUN_S,
        )
    assert done.returncode == 0, done.describe()
    assert done.stragglers == (), f"processes outlived `swarm run`: {done.stragglers}"
    records = done.json_records()
    assert len(records) == len(prompts)
    for i, record in enumerate(records):
        assert record["finish_reason"] != "error", record
        assert record["token_ids"] == refs[i]["token_ids"], f"prompt {prompts[i]!r}"
        assert record["text"] == refs[i]["text"]
        assert record["finish_reason"] == refs[i]["finish_reason"]
    assert any(len(r["token_ids"]) > 1 for r in records)
    return records


async def test_swarm_run_one_layer_blocks_matches_local(
    references: LocalReferences, llama_dir: Path, tmp_path: Path
) -> None:
    """Four one-layer stages in four processes give the tokens of `generate --local`."""
    spec = write_spec(
        tmp_path / "spec.toml",
        model_dir=llama_dir,
        blocks=[(0, 1), (1, 2), (2, 3), (3, 4)],
        limits=TINY_LIMITS,
    )
    records = await swarm_run_vs_local(references, spec, llama_dir, PROMPTS, tmp_path)
    nodes = {n["node"] for r in records for n in r["stats"]["nodes"]}
    assert nodes == {"s0", "s1", "s2", "s3"}


async def test_swarm_run_qwen2_uneven_split_matches_local(
    references: LocalReferences, qwen_dir: Path, tmp_path: Path
) -> None:
    """A Qwen2 checkpoint split 1 + 3 + 1 layers across processes gives the local tokens."""
    spec = write_spec(
        tmp_path / "spec.toml",
        model_dir=qwen_dir,
        blocks=[(0, 1), (1, 4), (4, 5)],
        limits=TINY_LIMITS,
    )
    await swarm_run_vs_local(references, spec, qwen_dir, PROMPTS, tmp_path)


async def test_swarm_run_smollm2_three_stages_matches_local(
    references: LocalReferences, smollm2_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2 over three processes ([0,7), [7,19), [19,30)) gives the local greedy tokens
    (both stored, the default for its quantized checkpoint)."""
    spec = write_spec(
        tmp_path / "spec.toml",
        model_dir=smollm2_dir,
        blocks=[(0, 7), (7, 19), (19, 30)],
        limits={"connect_timeout_s": 5.0},
    )
    prompts = ("The capital of France is", "Water boils at a temperature of")
    await swarm_run_vs_local(
        references, spec, smollm2_dir, prompts, tmp_path, max_tokens=24, max_len=2048
    )


async def test_swarm_run_with_link_latency_same_tokens_and_delayed_edges(
    references: LocalReferences, llama_dir: Path, tmp_path: Path
) -> None:
    """With 10 ms emulated per hop the tokens are unchanged and every edge shows >= ~10 ms."""
    spec = write_spec(
        tmp_path / "spec.toml",
        model_dir=llama_dir,
        blocks=[(0, 3), (3, 4)],
        latency_ms=10,
        limits=TINY_LIMITS,
    )
    records = await swarm_run_vs_local(references, spec, llama_dir, PROMPTS[:2], tmp_path)
    for record in records:
        edges = {(e["src"], e["dst"]): e["mean_s"] for e in record["stats"]["edges"]}
        assert set(edges) == {("coord", "s0"), ("s0", "s1"), ("s1", "coord")}
        # A lower bound only: the relay held every chunk >= 10 ms (allow 1 ms of clock slack).
        assert all(mean >= 0.009 for mean in edges.values()), edges


async def test_swarm_up_serves_generate_and_sigint_stops_every_node(
    references: LocalReferences, llama_dir: Path, tmp_path: Path
) -> None:
    """`swarm up` serves `generate --spec` like `--local`; SIGINT to it stops every child."""
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=llama_dir, blocks=[(0, 3), (3, 4)], limits=TINY_LIMITS
    )
    prompt = PROMPTS[0]
    log = tmp_path / "launcher.log"
    async with started_shard("swarm", "up", str(spec), stderr_path=log) as launcher:
        stdout = LineReader(launcher.stdout, log)
        async with trio.open_nursery() as nursery:
            want: dict[str, Any] = {}

            async def reference() -> None:
                (ref,) = await references.get(
                    llama_dir, [prompt], max_tokens=MAX_TOKENS, max_len=MAX_LEN
                )
                want.update(ref)

            nursery.start_soon(reference)
            with trio.fail_after(RUN_S):
                up = await stdout.line_starting("SHARD SWARM UP")
        fields = dict(part.split("=", 1) for part in up.split()[3:])
        children = {name: int(pid) for name, pid in fields.items() if name != "coordinator"}
        assert set(children) == {"coord", "s0", "s1"}
        assert all(alive(pid) for pid in children.values())

        got = await run_shard(
            "generate",
            "--spec",
            str(spec),
            "--json",
            "--max-tokens",
            str(MAX_TOKENS),
            prompt,
            timeout_s=60,
        )
        assert got.returncode == 0, got.describe()
        (record,) = got.json_records()
        assert record["token_ids"] == want["token_ids"]
        assert record["text"] == want["text"]

        launcher.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            code = await launcher.wait()
        # The launcher has reaped its children before exiting: none may be left.
        left = [name for name, pid in children.items() if alive(pid)]
        assert left == [], f"still running after the launcher exited: {left}"
        assert group_members(launcher.pid) == []
        assert orphans() == []
    assert code == 130, log.read_text()[-3000:]


async def swarm_up_children(launcher: trio.Process) -> dict[str, int]:
    """Wait for `swarm up`'s ``SHARD SWARM UP`` line; returns node -> PID from it."""
    with trio.fail_after(RUN_S):
        up = await LineReader(launcher.stdout).line_starting("SHARD SWARM UP")
    fields = dict(part.split("=", 1) for part in up.split()[3:])
    return {name: int(pid) for name, pid in fields.items() if name != "coordinator"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
async def test_backgrounded_swarm_up_stops_every_node_on_a_signal(
    llama_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """Started as a shell's `&` starts it (SIGINT ignored), `swarm up` stops every node on
    SIGTERM, SIGHUP and SIGINT alike, and exits 128 + the signal; no process is left."""
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=llama_dir, blocks=[(0, 4)], limits=TINY_LIMITS
    )
    log = tmp_path / "launcher.log"
    async with started_shard("swarm", "up", str(spec), stderr_path=log, background=True) as up:
        children = await swarm_up_children(up)
        assert set(children) == {"coord", "s0"}
        assert all(alive(pid) for pid in children.values())
        up.send_signal(sig)
        with trio.fail_after(30):
            code = await up.wait()
        left = [name for name, pid in children.items() if alive(pid)]
        assert left == [], f"still running after the launcher exited: {left}"
        assert orphans() == []
    assert code == 128 + sig, log.read_text()[-3000:]


async def test_a_sigkilled_swarm_up_takes_its_nodes_with_it(
    llama_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL, which the launcher cannot act on: every node notices its launcher is gone
    (``--die-with-parent``) and stops by itself, within seconds."""
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=llama_dir, blocks=[(0, 3), (3, 4)], limits=TINY_LIMITS
    )
    log = tmp_path / "launcher.log"
    async with started_shard("swarm", "up", str(spec), stderr_path=log) as up:
        children = await swarm_up_children(up)
        assert set(children) == {"coord", "s0", "s1"}
        up.kill()
        with trio.fail_after(30):
            await up.wait()
        left = await wait_gone(list(children.values()), timeout_s=30)
        assert left == [], f"outlived their SIGKILLed launcher: {left}"
    assert log.read_text().count("exited; stopping") == len(children), log.read_text()[-3000:]


async def test_bad_spec_is_one_line_error_naming_the_key(llama_dir: Path, tmp_path: Path) -> None:
    """An unknown key or overlapping layers: `swarm run|up` and `up` exit 1 with one line."""
    good = write_spec(
        tmp_path / "good.toml", model_dir=llama_dir, blocks=[(0, 3), (3, 4)], limits=TINY_LIMITS
    )
    typo = tmp_path / "typo.toml"
    typo.write_text(good.read_text().replace("insecure = true", 'insecure = true\nmodle = "x"'))
    overlap = tmp_path / "overlap.toml"
    overlap.write_text(good.read_text().replace("layers = [3, 4]", "layers = [2, 4]"))
    cases = [
        (typo, "swarm.modle", ("swarm", "run", str(typo), "--prompt", "hi")),
        (typo, "swarm.modle", ("up", "--role", "stage", "--spec", str(typo), "--node", "s0")),
        (overlap, "stage[1].layers", ("swarm", "run", str(overlap), "--prompt", "hi")),
        (overlap, "stage[1].layers", ("swarm", "up", str(overlap))),
        (overlap, "stage[1].layers", ("up", "--role", "coordinator", "--spec", str(overlap))),
    ]
    results: dict[int, Any] = {}

    async def one(i: int, args: tuple[str, ...]) -> None:
        results[i] = await run_shard(*args, timeout_s=60)

    async with trio.open_nursery() as nursery:
        for i, (_, _, args) in enumerate(cases):
            nursery.start_soon(one, i, args)
    for i, (path, key, _) in enumerate(cases):
        done = results[i]
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1, done.describe()
        assert len(lines) == 1, done.describe()
        assert lines[0].startswith(f"shard: error: {path}: {key}: "), lines[0]
        assert done.stdout == ""
        assert done.stragglers == ()


async def test_generate_against_a_swarm_that_is_not_running_fails_in_one_line(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`generate --spec` with nothing listening exits 1 with one clear line, in bounded time."""
    spec = write_spec(
        tmp_path / "spec.toml",
        model_dir=llama_dir,
        blocks=[(0, 4)],
        limits={"max_len": MAX_LEN, "connect_timeout_s": 1.0},
    )
    coordinator = next(
        line.split('"')[1] for line in spec.read_text().splitlines() if "listen" in line
    )
    done = await run_shard("generate", "--spec", str(spec), "hello", timeout_s=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.describe()
    assert len(lines) == 1, done.describe()
    assert lines[0].startswith("shard: error: "), lines[0]
    assert "could not reach" in lines[0]
    assert coordinator in lines[0]
    assert "Traceback" not in done.stderr


def test_spec_writer_round_trips(llama_dir: Path, tmp_path: Path) -> None:
    """The specs these tests write load as valid specs with distinct ports."""
    from shard.spec.swarm import load_spec

    spec = load_spec(
        write_spec(
            tmp_path / "s.toml",
            model_dir=llama_dir,
            blocks=[(0, 1), (1, 4)],
            latency_ms=10,
            limits=TINY_LIMITS,
        )
    )
    ports = {spec.coordinator.listen.port, *(s.listen.port for s in spec.stages)}
    assert len(ports) == 3
    assert spec.edge("coord", "s0").latency_ms == 10
    assert spec.limits.max_len == MAX_LEN
    assert Path(spec.model) == llama_dir.resolve()


async def test_swarm_run_with_a_port_in_use_fails_in_one_line_per_node(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A stage whose listen port is taken says so in one line (no traceback), and `swarm run`
    exits 1 with no process left behind."""
    import socket

    spec = write_spec(
        tmp_path / "spec.toml", model_dir=llama_dir, blocks=[(0, 2), (2, 4)], limits=TINY_LIMITS
    )
    s1 = [line.split('"')[1] for line in spec.read_text().splitlines() if "listen" in line][2]
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio binds
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        taken = f"127.0.0.1:{port}"
        spec.write_text(spec.read_text().replace(s1, taken))
        done = await run_shard("swarm", "run", str(spec), "--prompt", "hi", timeout_s=RUN_S)
    assert done.returncode == 1, done.describe()
    line = f"shard: error: cannot listen on {taken}: port {port} is already in use"
    assert line in done.stderr, done.describe()
    assert "Traceback" not in done.stderr, done.describe()
    assert done.stragglers == ()

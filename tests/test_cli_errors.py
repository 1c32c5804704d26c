"""Operator errors in one line: ``shard ...`` run in process, each mistake an operator can
make answered by one ``error:`` line (exit 1, or 2 for options that do not go together),
never a traceback, and before any model loads or process starts.

Charter: loopback only (port-in-use tests hold a port found by binding port 0); no model is
loaded except the tiny checkpoints of ``conftest.py``.
"""

from __future__ import annotations

import errno
import io
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from shard import __version__
from shard.cli import main
from shard.cli.relay import relay_main
from shard.transport import ListenError, WebSocketNetwork
from shard.transport.base import open_listeners
from shard.transport.relay import DelayRelay

DEADLINE_S = 20


def one_error(capsys: pytest.CaptureFixture[str], prefix: str = "shard: error: ") -> str:
    """The one line on stderr (asserted to be the only one and to start with ``prefix``)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else is listening on for the test's duration."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio binds
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`shard --version` prints `shard 0.1.0` and exits 0."""
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"shard {__version__}\n"
    assert __version__ == "0.1.0"


# --- options that do not apply are refused, not ignored ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--local", "--receipt", "run.json"], "--receipt applies only with --spec"),
        (["--local", "--key", "k.key"], "--key applies only with --spec"),
        (["--local", "--token", "k.token"], "--token applies only with --spec"),
        (["--local", "--k", "4"], "--k applies only with --spec"),
        (["--local", "--depth", "2"], "--depth applies only with --spec"),
        (["--spec", "nowhere.toml", "--model", "m"], "--model applies only with --local"),
        (["--spec", "nowhere.toml", "--max-len", "64"], "--max-len applies only with --local"),
    ],
)
def test_an_option_of_the_other_mode_is_refused(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --local --receipt`, `--spec --model` and the like exit 2 naming the option."""
    assert main(["generate", *argv, "hello"]) == 2
    line = one_error(capsys, "shard generate: error: ")
    assert flag in line


def test_monitor_key_without_spec_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`monitor ADDRESS --swarm X --key K` exits 2: the secure wire needs the spec's authority."""
    assert main(["monitor", "127.0.0.1:1", "--swarm", "x", "--key", "k.key"]) == 2
    assert "--key/--token need --spec" in one_error(capsys, "shard monitor: error: ")
    assert main(["monitor", "127.0.0.1:1"]) == 2
    assert "give --spec SPEC, or ADDRESS and --swarm NAME" in one_error(capsys, "shard monitor: ")


# --- input that is not UTF-8, a prompts file that is not there ---------------------------------


def test_non_utf8_prompt_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt argument with a byte that is not UTF-8 (as Python passes it: surrogateescape)
    exits 1 saying which byte, before any model loads."""
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    assert main(["generate", "--local", "--model", "/nonexistent", prompt]) == 1
    line = one_error(capsys)
    assert "the prompt argument is not UTF-8 (byte 0xe9 at offset 3, line 1)" in line


def test_non_utf8_stdin_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate -` with standard input that is not UTF-8 exits 1 naming standard input."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\xfe")))
    assert main(["generate", "--local", "--model", "/nonexistent", "-"]) == 1
    assert "standard input is not UTF-8 (byte 0xff at offset 3, line 2)" in one_error(capsys)


def test_prompts_file_missing_or_not_utf8_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`swarm run --prompts F`: F missing, or with a Latin-1 byte on line 2, exits 1 in one
    line naming F, before the spec is even read."""
    missing = tmp_path / "prompts.txt"
    assert main(["swarm", "run", "no-such-spec.toml", "--prompts", str(missing)]) == 1
    line = one_error(capsys)
    assert f"--prompts {missing}: cannot read it: No such file or directory" in line
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first prompt\nthé\n".encode("latin-1"))
    assert main(["swarm", "run", "no-such-spec.toml", "--prompts", str(latin1)]) == 1
    assert f"--prompts {latin1} is not UTF-8 (byte 0xe9 at offset 15, line 2)" in one_error(capsys)


def test_non_utf8_swarm_run_prompt_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`swarm run --prompt P` with a byte that is not UTF-8 exits 1 before the spec is read."""
    prompt = b"\x80abc".decode("utf-8", "surrogateescape")
    assert main(["swarm", "run", "no-such-spec.toml", "--prompt", prompt]) == 1
    assert "the prompt argument is not UTF-8 (byte 0x80 at offset 0" in one_error(capsys)


# --- a bad GGUF -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"", b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00garbage"]
)
def test_bad_gguf_with_local_is_one_line(
    content: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`generate --local --model bad.gguf` (empty, not GGUF, truncated) exits 1 naming the file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    assert main(["generate", "--local", "--model", str(bad), "hello"]) == 1
    assert f"{bad}: not a readable GGUF file" in one_error(capsys)


def test_a_broken_chat_template_with_local_chat_is_one_line(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --local --chat` with a chat template that does not compile exits 1 with one
    line naming the template's file (not a traceback)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint(seed=4, n_layers=2), model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    argv = ["generate", "--local", "--chat", "--model", str(model), "--max-tokens", "2", "hi"]
    assert main(argv) == 1
    line = one_error(capsys)
    assert f"{model / 'chat_template.jinja'}: the chat template does not compile" in line


# --- a port already in use --------------------------------------------------------------------


async def test_serving_on_a_taken_port_is_a_listen_error(taken_port: int) -> None:
    """WebSocketNetwork.serve on a port in use raises ListenError naming the address."""
    address = f"127.0.0.1:{taken_port}"

    async def handler(conn: object) -> None:
        raise AssertionError("nothing may connect")

    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork() as net:
            with pytest.raises(ListenError) as caught:
                await net.serve(address, handler)  # type: ignore[arg-type]
    text = str(caught.value)
    assert text.startswith(f"cannot listen on {address}: port {taken_port} is already in use")
    assert "stop it, or give this node another port" in text
    assert "\n" not in text


@pytest.mark.parametrize("role", ["stage", "coordinator", "coordinator-api"])
def test_a_node_on_a_taken_port_says_so_before_loading_weights(
    role: str, taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard up` on a taken port (a stage's, the coordinator's or its API's) says so
    first: the model folder here has no weights at all, so an error about them would mean
    the node began loading before it looked at its port."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    taken = f"127.0.0.1:{taken_port}"
    free = "127.0.0.1:0"
    node, listen = ("s0", taken) if role == "stage" else ("coord", free)
    api = f'[api]\nlisten = "{taken}"\n' if role == "coordinator-api" else ""
    coordinator = taken if role == "coordinator" else free
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'[swarm]\nname = "t"\nmodel = "{model}"\ninsecure = true\n{api}'
        f'[coordinator]\nlisten = "{coordinator}"\n'
        f'[[stage]]\nname = "s0"\nlisten = "{listen if role == "stage" else free}"\n'
        'layers = "auto"\n'
    )
    argv = ["up", "--role", role.split("-")[0], "--spec", str(spec), "--node", node]
    assert main(argv) == 1
    err = capsys.readouterr().err
    *before, line = err.strip().splitlines()
    assert line.startswith(f"shard: error: cannot listen on {taken}: port {taken_port} is"), err
    assert all("insecure = true" in other for other in before), err  # its warning, no more


async def test_relay_on_a_taken_port_is_a_listen_error(taken_port: int) -> None:
    """A DelayRelay whose listen port is taken raises the same ListenError."""
    relay = DelayRelay(f"127.0.0.1:{taken_port}", "127.0.0.1:1", latency_s=0.0)
    with trio.fail_after(DEADLINE_S), pytest.raises(ListenError, match="already in use"):
        await relay.run()


@pytest.mark.parametrize(
    ("address", "why"),
    [
        (
            "192.0.2.1:0",
            "192.0.2.1 is not an address of this machine; listen on one of its own addresses",
        ),
        ("127.0.0.1:1", "permission denied for port 1; use a port from 1024 up"),
    ],
)
async def test_other_bind_failures_say_what_to_do(
    address: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An address not of this machine, or a privileged port, is one line saying which.

    The errors are injected (the test may run as root, which may bind port 1)."""
    code = errno.EADDRNOTAVAIL if "192.0.2.1" in address else errno.EACCES

    async def refuse(port: int, *, host: str) -> None:
        raise OSError(code, "injected")

    monkeypatch.setattr(trio, "open_tcp_listeners", refuse)
    with pytest.raises(ListenError) as caught:
        await open_listeners(address)
    assert str(caught.value) == f"cannot listen on {address}: {why}"


def test_relay_command_on_a_taken_port_is_one_line(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard relay --listen` on a port in use exits 1 with one line."""
    argv = ["--listen", f"127.0.0.1:{taken_port}", "--target", "127.0.0.1:1", "--latency-ms", "1"]
    assert relay_main(argv) == 1
    assert "already in use" in one_error(capsys, "shard relay: error: cannot listen on")


def test_node_on_a_taken_port_is_one_line(
    taken_port: int,
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard up --role coordinator` whose listen port is in use exits 1 with one line naming
    the address (it was 53 lines of traceback)."""
    from procs import write_spec

    model = tiny_checkpoint(seed=3, n_layers=2)
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=model, blocks=[(0, 2)], limits={"max_len": 256}
    )
    text = spec.read_text()
    coordinator = next(line.split('"')[1] for line in text.splitlines() if "listen" in line)
    spec.write_text(text.replace(coordinator, f"127.0.0.1:{taken_port}", 1))
    assert main(["up", "--role", "coordinator", "--spec", str(spec)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == [
        f"shard: error: cannot listen on 127.0.0.1:{taken_port}: port {taken_port} is already "
        "in use (another node, a swarm from the same spec or another program is listening "
        "there); stop it, or give this node another port"
    ], err
    assert "Traceback" not in err


def test_swarm_up_with_a_busy_api_port_is_one_line(
    taken_port: int,
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`swarm up --api PORT` on a port in use exits 1 with one line naming the API address,
    before any node starts (it was ~60 lines of exception groups from the coordinator)."""
    from procs import write_spec

    model = tiny_checkpoint(seed=3, n_layers=2)
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=model, blocks=[(0, 2)], limits={"max_len": 256}
    )
    argv = ["swarm", "up", str(spec), "--model", str(model), "--api", str(taken_port)]
    assert main(argv) == 1  # before any node starts: nothing to wait for
    assert one_error(capsys) == (
        f"shard: error: cannot serve the HTTP API on 127.0.0.1:{taken_port}: port "
        f"{taken_port} is already in use (another program, or another swarm's API, is "
        "listening there); stop it, or give --api (or [api] listen) another port"
    )


async def test_a_coordinator_api_on_a_busy_port_is_a_listen_error(taken_port: int) -> None:
    """The coordinator's API server on a port in use raises one ListenError (not a nest of
    exception groups around the OSError), for the port taken between the check and the bind."""
    from shard.api.server import ApiServer
    from shard.nodes.api import serve_api

    listen = f"127.0.0.1:{taken_port}"
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            with pytest.raises(ListenError) as caught:
                await serve_api(nursery, ApiServer(None, listen), listen)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"cannot serve the HTTP API on {listen}: port ")
    assert "already in use" in str(caught.value)


def test_up_as_an_auditor_that_the_spec_does_not_declare_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard up --role auditor` for a node that is a standby (no `role = "auditor"`) exits 2
    with one line naming the spec's auditors (none here), before any model loads."""
    spec = Path(__file__).parent.parent / "specs" / "failover.toml"
    assert main(["up", "--role", "auditor", "--spec", str(spec), "--node", "s1-standby"]) == 2
    line = one_error(capsys)
    assert line == (
        f"shard: error: no auditor 's1-standby' in {spec} ([[standby]] tables with "
        'role = "auditor": none)'
    ), line


# --- the monitor on a secure swarm --------------------------------------------------------------


def test_monitor_joins_a_secure_swarm_with_key_and_token(
    tmp_path: Path,
    tiny_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`monitor --spec SECURE --key K --token T` watches on the secure wire as role monitor;
    `swarm up --monitor` presents the spec's client credentials; a token without role monitor
    is refused in one line."""
    import time

    import shard.observe.tui.main as tui
    from shard.nodes.compose import provision_local
    from shard.transport.secure import SecureWebSocketNetwork

    root = Path(__file__).resolve().parents[1]
    spec = tmp_path / "spec.toml"
    shutil.copy(root / "specs" / "local-secure.toml", spec)
    nodes = {"coord": ["coordinator"], "s0": ["stage"], "s1": ["stage"], "s2": ["stage"]}
    roles = {**nodes, "client": ["client", "monitor"], "watcher": ["monitor"], "cli": ["client"]}
    keys = tmp_path / "local-secure"
    provision_local(keys, swarm="local-secure", nodes=roles, now=time.time())
    seen: list[tuple[str, SecureWebSocketNetwork]] = []

    def watch(address: str, *, network: SecureWebSocketNetwork, **_: object) -> None:
        seen.append((address, network))

    def watch_swarm(*_: object, address: str, network: SecureWebSocketNetwork, **__: Any) -> None:
        seen.append((address, network))

    monkeypatch.setattr(tui, "monitor", watch)
    monkeypatch.setattr(tui, "monitor_swarm", watch_swarm)
    watcher = ["--key", str(keys / "watcher.key"), "--token", str(keys / "watcher.token")]
    assert main(["monitor", "--spec", str(spec), *watcher]) == 0
    model = str(tiny_checkpoint(seed=3, n_layers=3))  # one layer per stage: swarm up plans
    assert main(["swarm", "up", str(spec), "--monitor", "--model", model, "--verbose"]) == 0
    assert "swarm up:    the spec as written" in capsys.readouterr().err  # its plan, first
    assert [address for address, _ in seen] == ["127.0.0.1:7740", "127.0.0.1:7740"]
    assert all(isinstance(net, SecureWebSocketNetwork) for _, net in seen)
    client_only = ["--key", str(keys / "cli.key"), "--token", str(keys / "cli.token")]
    assert main(["monitor", "--spec", str(spec), *client_only]) == 1
    assert "allows the roles client, not 'monitor'" in one_error(capsys)
    assert len(seen) == 2


def test_coordinator_with_an_unfinished_head_is_one_line(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`draft = "head"` whose draft_head directory holds no finished head (no train.json):
    the coordinator exits 1 with one line saying so, not a traceback."""
    from procs import write_spec

    model = tiny_checkpoint(seed=3, n_layers=2)
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=model, blocks=[(0, 2)], limits={"max_len": 256}
    )
    (tmp_path / "half-head").mkdir()
    with spec.open("a", encoding="utf-8") as f:
        f.write('\n[speculation]\ndraft = "head"\ndraft_head = "half-head"\n')
    assert main(["up", "--role", "coordinator", "--spec", str(spec)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "is not a finished draft head (no train.json)" in errors[0]

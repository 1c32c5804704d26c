"""What ``shard swarm run|up`` and ``shard generate --spec`` print, as a new user meets it:
the answer first (the placement plan only with ``--verbose``), a warning only when it asks
for something and then once, and a client whose coordinator died told so at once.

Charter: loopback only; the processes started (a fake coordinator, the client) run in their
own sessions and are killed with their groups by PID (``tests/procs.py``); every run bounded.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from procs import LineReader, run_python, run_shard, started_python, write_spec
from shard.cli.parser import build_parser
from shard.cli.swarm import _warn_insecure, planned
from shard.spec.swarm import load_spec

RUN_S = 60.0


@pytest.fixture
def spec_path(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    model = tiny_checkpoint(seed=3, n_layers=4)
    return write_spec(tmp_path / "spec.toml", model_dir=model, blocks=[(0, 2), (2, 4)])


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"rtt": None, "as_written": False, **kw})


def test_the_plan_is_printed_only_with_verbose(
    spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ring the plan keeps as written prints nothing before the answer; --verbose prints
    the plan and the decision (it was ~20 lines on every run)."""
    spec = load_spec(spec_path)
    model = Path(spec.model)
    assert planned(spec, model, _args(verbose=False)) == (spec, None)
    assert capsys.readouterr().err == ""
    assert planned(spec, model, _args(verbose=True)) == (spec, None)
    err = capsys.readouterr().err
    assert "predicted lap:" in err
    assert err.splitlines()[-1].startswith("swarm up:    the spec as written")


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["swarm", "run", "s.toml", "--prompt", "p"], False),
        (["swarm", "run", "s.toml", "--prompt", "p", "--verbose"], True),
        (["swarm", "up", "s.toml", "-v"], True),
        (["-v", "swarm", "run", "s.toml", "--prompt", "p"], True),
    ],
)
def test_verbose_is_taken_before_or_after_the_subcommand(argv: list[str], verbose: bool) -> None:
    """`swarm run|up --verbose` (or -v) and `shard -v swarm ...` both turn it on; neither
    leaves it off (the subcommand's flag never resets the global one)."""
    assert build_parser().parse_args(argv).verbose is verbose


def test_insecure_is_warned_once_and_only_beyond_loopback(
    spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An insecure swarm on loopback (the documented local setup) gets no warning; one that
    listens beyond loopback gets one line for the whole swarm, naming the nodes."""
    _warn_insecure(load_spec(spec_path))
    assert capsys.readouterr().err == ""
    text = spec_path.read_text()
    stage = next(line for line in text.splitlines() if "listen" in line and "127.0.0.1" in line)
    spec_path.write_text(text.replace(stage, stage.replace("127.0.0.1", "0.0.0.0"), 1))
    _warn_insecure(load_spec(spec_path))
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("shard: WARNING: insecure = true and coord listen beyond loopback")


_IMPORTS = """
import sys
from shard.cli.errors import operator_errors
before = set(sys.modules)
operator_errors()
print(sorted(set(sys.modules) - before))
"""


async def test_reporting_an_operator_error_imports_nothing() -> None:
    """Deciding whether an error is an operator's imports no module: it imported all of them
    (torch among them), which kept a client whose coordinator died waiting 10-18 s."""
    done = await run_python(_IMPORTS, timeout_s=RUN_S)
    assert done.returncode == 0, done.describe()
    assert done.stdout.strip() == "[]"


def test_every_operator_error_names_its_defining_module() -> None:
    """Each entry of the table is the module that defines the class (a re-export's module may
    be absent from sys.modules while the class was raised)."""
    import importlib

    from shard.cli.errors import _OPERATOR_ERRORS

    for module, name in _OPERATOR_ERRORS:
        assert getattr(importlib.import_module(module), name).__module__ == module, name


#: A coordinator that streams one chunk of text and is then SIGKILLed (by itself).
_DYING_COORDINATOR = """
import os, signal, sys
import trio
from shard.messages import GenerateRequest, NodeName, TokensOut
from shard.messages.ring import Welcome
from shard.transport import WebSocketNetwork
from shard.transport.links import accept_peer

async def handler(conn):
    await accept_peer(conn, Welcome(node=NodeName("coord"), role="coordinator", swarm="test"))
    req = await conn.receive()
    assert isinstance(req, GenerateRequest)
    await conn.send(TokensOut(req.request, (1,), "Once upon"))
    await trio.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)

async def main():
    async with WebSocketNetwork() as net, trio.open_nursery() as nursery:
        await nursery.start(net.serve, sys.argv[1], handler)
        print("READY", flush=True)

trio.run(main)
"""


async def test_a_killed_coordinator_fails_its_client_in_one_line(spec_path: Path) -> None:
    """`shard generate --spec` whose coordinator is killed mid-request ends its streamed line
    and exits 1 with one line saying the coordinator went away (not a bare 1006)."""
    spec = load_spec(spec_path)
    listen = str(spec.coordinator.listen)
    with trio.fail_after(RUN_S):
        async with started_python(_DYING_COORDINATOR, listen) as fake:
            await LineReader(fake.stdout).line_starting("READY")
            done = await run_shard("generate", "--spec", str(spec_path), "hi", timeout_s=RUN_S)
            assert await fake.wait() == -9
    assert done.returncode == 1, done.describe()
    assert done.stdout == "Once upon\n"
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"shard: error: the coordinator at {listen} closed the connection before the request "
        "finished ("
    ), line
    assert line.endswith("it stopped or was killed; see its log, restart the swarm and retry")


def test_a_replaced_node_says_so_without_an_error_and_exits_3(
    spec_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shard up` for a node the scheduler refused as replaced (evicted, or woken after a
    freeze) prints what happened in one line without `error:` and exits 3 — it printed
    `shard: error: ... replaced` for a run that succeeded. The refusal is injected as the
    node's nursery raises it (in a group)."""
    from shard.cli import main, up
    from shard.failover.control import NodeReplaced

    said = "s0: the scheduler refused this node: s0 was replaced by sb; restart it as a standby"

    async def refused(*_: object) -> None:
        raise BaseExceptionGroup("node", [ExceptionGroup("stage", [NodeReplaced(said)])])

    monkeypatch.setattr(up, "_run_node", refused)
    monkeypatch.setattr("shard.nodes.lifeline.die_with_parent", lambda *_: None)  # not ours
    argv = ["up", "--role", "stage", "--spec", str(spec_path), "--node", "s0"]
    assert main([*argv, "--die-with-parent", "1"]) == 3  # as launched: the swarm warns once
    assert capsys.readouterr().err == f"shard: {said}\n"


def test_the_launcher_logs_a_replaced_node_as_info(caplog: pytest.LogCaptureFixture) -> None:
    """A child that exits 3 (replaced) is an INFO line, not the warning of a node that died;
    both are passed on as `SHARD NODE EXITED`."""
    import logging

    from shard.nodes.launcher import REPLACED_EXIT, NodeExit, Supervisor

    supervisor = Supervisor("coord", set(), up=True)
    with caplog.at_level(logging.INFO, logger="shard.nodes.launcher"):
        seen: list[NodeExit] = [
            supervisor.exited("s1", 41, REPLACED_EXIT),
            supervisor.exited("s2", 42, -9),
        ]
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[0] == ("INFO", "node s1 (pid 41) was replaced by a standby and stopped")
    assert levels[1][0] == "WARNING"
    assert [e.line() for e in seen] == [
        "SHARD NODE EXITED node=s1 pid=41 code=3",
        "SHARD NODE EXITED node=s2 pid=42 code=-9",
    ]

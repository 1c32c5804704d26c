"""One command table: every ``shard`` subcommand's arguments are declared in ``shard.cli`` and
run by a handler there; no module outside ``shard.cli`` parses arguments (read from the
source with ``ast``, function-local imports included)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from shard.cli import HANDLERS, handler, main
from shard.cli.parser import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"
PARSERS = ("argparse", "optparse", "getopt")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _commands() -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return dict(subs[0]._name_parser_map)


def test_no_module_outside_cli_imports_an_argument_parser() -> None:
    """Only ``shard.cli`` imports argparse (or optparse, getopt): every command's arguments
    live in its one table."""
    outside = [p for p in sorted(SRC.rglob("*.py")) if (SRC / "cli") not in p.parents]
    assert len(outside) > 100  # the walk found the package
    offenders = {
        str(p.relative_to(SRC)): sorted(_imports(p) & set(PARSERS))
        for p in outside
        if _imports(p) & set(PARSERS)
    }
    assert offenders == {}


def test_every_subcommand_has_a_handler_in_cli() -> None:
    """Every subcommand of ``build_parser()`` (convert, relay, draft and bench among them) has
    a handler in ``shard.cli``, and every handler a subcommand."""
    commands = _commands()
    assert {"convert", "relay", "draft", "bench", "generate", "swarm"} <= set(commands)
    assert set(commands) == set(HANDLERS)
    for name in commands:
        module, _ = HANDLERS[name]
        assert module.startswith("shard.cli."), name
        assert callable(handler(name)), name


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``shard NAME --help`` prints its usage and exits 0 for every subcommand."""
    try:
        code = main([name, "--help"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 0
    assert capsys.readouterr().out.startswith(f"usage: shard {name} ")


def test_tool_usage_errors_keep_their_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """convert and draft report a usage error in one line and return 2; relay and bench keep
    argparse's usage block and exit 2 under their own name."""
    assert main(["convert", "a.gguf", "out", "extra"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "shard convert: error: unrecognized arguments: extra (see shard convert --help)\n"
    )
    assert main(["draft", "train", "--minutes", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shard draft: error: argument --minutes:") and err.count("\n") == 1
    for argv in (["relay", "--listen", "127.0.0.1:0"], ["bench", "--bogus"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert f"shard {argv[0]}: error: " in capsys.readouterr().err


def test_the_top_help_imports_no_command() -> None:
    """``shard --help`` lists every command without importing torch, trio or the transport
    (draft's and relay's defaults are read only when those commands parse)."""
    code = (
        "import sys; from shard.cli.parser import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'trio', 'shard.transport') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"

"""``shard generate`` and ``swarm run`` bound every number with the one table the API and the
coordinator use (``shard.messages.bounds``): a value in range is taken (``--top-p 1e-300``
was refused), one past what the wire carries is a usage error naming the bound."""

from __future__ import annotations

import pytest

from shard.cli.parser import build_parser
from shard.messages.bounds import BOUNDS, INT64_MAX, MAX_COUNT


def parse(*flags: str) -> object:
    return build_parser().parse_args(["generate", "--local", "hi", *flags])


@pytest.mark.parametrize(
    ("flag", "text", "value"),
    [
        ("--top-p", "1e-300", 1e-300),
        ("--top-p", "1", 1.0),
        ("--top-k", str(MAX_COUNT), MAX_COUNT),
        ("--seed", str(INT64_MAX), INT64_MAX),
        ("--seed", "-5", -5),
        ("--temperature", "100", 100.0),
        ("--max-tokens", str(MAX_COUNT), MAX_COUNT),
    ],
)
def test_values_inside_the_table_are_taken(flag: str, text: str, value: object) -> None:
    """Each edge of a bound, from inside, parses to its value."""
    args = parse(flag, text)
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == value


@pytest.mark.parametrize(
    ("flag", "text", "field"),
    [
        ("--top-p", "0", "top_p"),
        ("--top-p", "nan", "top_p"),
        ("--top-p", "1.0000001", "top_p"),
        ("--top-k", "9223372036854775808", "top_k"),
        ("--top-k", "-1", "top_k"),
        ("--seed", str(1 << 64), "seed"),
        ("--temperature", "1e309", "temperature"),
        ("--temperature", "inf", "temperature"),
        ("--max-tokens", "0", "max_tokens"),
        ("--max-tokens", "1.5", "max_tokens"),
    ],
)
def test_values_past_the_table_are_usage_errors(
    flag: str, text: str, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value outside its bound exits 2 with the bound's own description."""
    with pytest.raises(SystemExit) as exited:
        parse(flag, text)
    assert exited.value.code == 2
    assert BOUNDS[field].describe() in capsys.readouterr().err


def test_swarm_run_uses_the_same_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """swarm run's sampling flags are the same table's."""
    parser = build_parser()
    args = parser.parse_args(["swarm", "run", "spec.toml", "--prompt", "hi", "--top-p", "1e-300"])
    assert args.top_p == 1e-300
    with pytest.raises(SystemExit):
        parser.parse_args(["swarm", "run", "spec.toml", "--prompt", "hi", "--k", "65"])
    assert BOUNDS["k"].describe() in capsys.readouterr().err

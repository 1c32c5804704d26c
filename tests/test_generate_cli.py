"""``shard generate`` in process: ``--ignore-eos`` runs a fixed length, locally and through
the ring (the ``GenerateRequest.ignore_eos`` field) alike, and ``-`` reads the prompt from
standard input.

The tiny checkpoint is copied with its end-of-sequence id set to a token its greedy output
contains, so a request without ``--ignore-eos`` really stops early.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from shard.cli import main
from shard.coordinator.service import complete, prompt_ids
from shard.decode.reference import generate_reference
from shard.messages import GenerateDone, GenerateRequest, Message
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec

PROMPT = "in the beginning the river"
MAX_TOKENS = 12
MAX_LEN = 128
DEADLINE_S = 60.0


def _eos_ids(model_dir: Path) -> set[int]:
    return {*ModelConfig.from_dir(model_dir).eos_token_ids, *Tokenizer.from_dir(model_dir).eos_ids}


@pytest.fixture(scope="module")
def stopping(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, tuple[int, ...]]:
    """A tiny model whose EOS id occurs in its greedy output, and that output run to
    ``MAX_TOKENS`` with EOS ignored."""
    base = tiny_checkpoint(seed=3, n_layers=2)
    model = load_stage(base, 0, 2)
    ids = prompt_ids(Tokenizer.from_dir(base), GenerateRequest(1, PROMPT, MAX_TOKENS))
    full = generate_reference(model, ids, max_tokens=MAX_TOKENS, eos_ids=(), max_len=MAX_LEN)
    assert full.finish_reason == "length" and len(full.token_ids) == MAX_TOKENS
    made = tmp_path_factory.mktemp("stopping") / "m"
    shutil.copytree(base, made)
    config = json.loads((made / "config.json").read_text())
    config["eos_token_id"] = [full.token_ids[MAX_TOKENS // 2]]
    (made / "config.json").write_text(json.dumps(config))
    return made, full.token_ids


def _stopped(model_dir: Path, full: tuple[int, ...]) -> tuple[int, ...]:
    """``full`` cut before its first EOS id: what a request that stops at EOS gives."""
    eos = _eos_ids(model_dir)
    end = next(i for i, t in enumerate(full) if t in eos)
    assert end < MAX_TOKENS
    return full[:end]


def _local(capsys: pytest.CaptureFixture[str], model_dir: Path, *argv: str) -> dict[str, Any]:
    common = ["--json", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS)]
    code = main(["generate", "--local", *common, "--max-len", str(MAX_LEN), *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    record: dict[str, Any] = json.loads(out)
    return record


def test_local_ignore_eos_runs_max_tokens(
    stopping: tuple[Path, tuple[int, ...]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --local` stops at EOS; with `--ignore-eos` it runs exactly --max-tokens."""
    model_dir, full = stopping
    stopped = _local(capsys, model_dir, PROMPT)
    assert tuple(stopped["token_ids"]) == _stopped(model_dir, full)
    assert stopped["finish_reason"] == "stop"
    ignoring = _local(capsys, model_dir, "--ignore-eos", PROMPT)
    assert tuple(ignoring["token_ids"]) == full
    assert ignoring["finish_reason"] == "length"


def test_prompt_from_stdin_equals_the_argument(
    stopping: tuple[Path, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`generate -` reads the prompt from standard input (one trailing newline dropped)."""
    model_dir, _ = stopping
    want = _local(capsys, model_dir, "--ignore-eos", PROMPT)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(f"{PROMPT}\n".encode())))
    got = _local(capsys, model_dir, "--ignore-eos", "-")
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]


async def test_ring_ignore_eos_matches_local(stopping: tuple[Path, tuple[int, ...]]) -> None:
    """Through a two-stage ring, `GenerateRequest.ignore_eos` runs past EOS to max_tokens and
    gives the reference's ids; without it the ring stops where the reference does."""
    model_dir, full = stopping
    spec = SwarmSpec.from_dict(
        {
            "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
            "limits": {"max_len": MAX_LEN, "prefill_chunk": 4},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
            "stage": [
                {"name": "s0", "listen": "127.0.0.1:9001", "layers": [0, 1]},
                {"name": "s1", "listen": "127.0.0.1:9002", "layers": [1, 2]},
            ],
        },
        source="test.toml",
    )
    done: list[GenerateDone] = []

    async def keep(msg: Message) -> None:
        if isinstance(msg, GenerateDone):
            done.append(msg)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=model_dir, task_status=task_status)
            )
            for ignore in (False, True):
                request = GenerateRequest(1, PROMPT, MAX_TOKENS, ignore_eos=ignore)
                await complete(handle.coordinator, handle.text, request, keep)
            nursery.cancel_scope.cancel()
    stopped, ignoring = done
    assert (stopped.token_ids, stopped.finish_reason) == (_stopped(model_dir, full), "stop")
    assert (ignoring.token_ids, ignoring.finish_reason) == (full, "length")


def test_an_empty_prompt_or_a_missing_chat_template_is_refused_before_the_weights_load(
    stopping: tuple[Path, tuple[int, ...]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An empty prompt (argument or standard input), and ``--chat`` on a model without a chat
    template (a base model), are one-line errors before ``load_stage`` runs: the operator
    does not wait for the weights to hear it."""

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("the weights were loaded before the input was checked")

    monkeypatch.setattr("shard.model.loader.load_stage", never)
    model_dir, _ = stopping
    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    for argv in (["--model", str(model_dir), ""], ["--model", str(base), "--chat", "Hi"]):
        assert main(["generate", "--local", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("shard"), err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert main(["generate", "--local", "--model", str(model_dir), "-"]) != 0
    assert "the prompt is empty" in capsys.readouterr().err

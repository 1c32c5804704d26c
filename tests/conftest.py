"""Shared fixtures: tiny random checkpoints, built once per session and per shape."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shard.model.cachedir import cache_dir
from shard.testing import make_tiny_checkpoint

# One build of the C++ extension (the native forward and the q8 product,
# ``shard.model.native_build``) for the whole run and every process it starts: tests that point
# XDG_CACHE_HOME at an empty folder would otherwise each compile it again (~40 s).
os.environ.setdefault("SHARD_NATIVE_DIR", str(cache_dir() / "native"))


@pytest.fixture(scope="session", autouse=True)
def _native_built() -> None:
    """The extension built before any test (``ops/bootstrap`` has built it already; a bare
    ``pytest`` builds it here), not inside a swarm test's node under its deadlines."""
    from shard.model import native_build

    native_build.build()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(**kw)`` -> a ``make_tiny_checkpoint`` dir, cached by ``kw``.

    Tests must not modify the returned directory; copy it first (see ``test_model_loader``).
    """
    made: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(**kw: Any) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2, converted once into the user cache (shared with ``shard``)."""
    from fixtures_smollm2 import smollm2_dir as converted

    return converted()


@pytest.fixture(scope="session")
def smollm2_float32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2 converted to float32 (what transformers loads; the cache entry
    keeps its quantized tensors as stored), once per session."""
    from shard.convert.bundled import _bundled_gguf
    from shard.convert.gguf_import import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "float32"
    return convert_gguf(_bundled_gguf("smollm2"), out, progress=False, stored=False)


@pytest.fixture(scope="session")
def agreeable_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(target, head)``: the head tests' shared tiny target and the draft head trained on it
    (``tests/head_fixtures.py``), once per session."""
    from head_fixtures import agreeable_target, train_tiny_head

    target = agreeable_target(tmp_path_factory.mktemp("agreeable"))
    return target, train_tiny_head(target, tmp_path_factory.mktemp("head"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-seed",
        type=int,
        default=None,
        help="seed of the live fuzz tests (test_fuzz_links, test_fuzz_fetch); default: their SEED",
    )


_MEASURED: list[str] = []


@pytest.fixture
def report() -> Callable[[str], None]:
    """``report(line)``: a measurement the test made (not asserted: tests assert behaviour,
    never speed), printed in the terminal summary of every run, CI included."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MEASURED:
        terminalreporter.section("measured (reported, not asserted)")
        for line in _MEASURED:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _evidence_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strikes in tests write their evidence files under the test's own temporary directory,
    not into the user's cache (``[audit] evidence_dir`` absent means the cache)."""
    from shard.audit import evidence_files

    monkeypatch.setattr(evidence_files, "default_evidence_dir", lambda: tmp_path / "evidence")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The whole run computes on one torch thread, like every process it starts
    (``procs.child_env``): tiny models gain nothing from threads, and OpenMP's spin-waits
    stall a busy machine (a hold-mode audit test took 47 s on two threads beside other
    processes, 6 s on one; SmolLM2 against transformers 154 s against 20 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test, whatever an earlier test set (the session already runs
    on one: ``_one_torch_thread``; modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

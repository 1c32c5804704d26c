"""Speculative decoding and receipts with real processes: ``shard swarm run`` with drafts and
pipelined chunks equals ``shard generate --local``, and its signed receipt verifies offline.

Charter as in ``test_swarm_cli``: loopback only, free ports, every process killed by PID.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from procs import LineReader, run_python, run_shard, started_shard, write_spec
from shard.coordinator.client import request as ask_swarm
from shard.decode.reference import generate_reference
from shard.messages import GenerateRequest
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.nodes.compose import client_network
from shard.spec.swarm import load_spec
from test_speculation_ring import k_depth_params

pytestmark = pytest.mark.slow

PROMPTS = ("in in in the the river river", "Hello, world! Hello, world! Hello")
#: Prompts on which the n-gram, the head trained for seconds and the hybrid guess some of
#: the tiny model's tokens right (the grid asserts accepted drafts), so accepted drafts
#: cross the processes too; PROMPTS are for the model draft.
GUESSABLE = ("a a a a a a a a", "1 2 3 1 2 3 1 2 3")
MAX_TOKENS = 20
MAX_LEN = 256
RUN_S = 150.0
TIE = 1e-4

_LOCAL = """
import sys
from shard.cli import main
model, *prompts = sys.argv[1:]
for prompt in prompts:
    code = main(["generate", "--local", "--json", "--model", model, "--max-tokens", "20",
                 "--max-len", "256", prompt])
    if code != 0:
        sys.exit(code)
"""


@pytest.fixture(scope="module")
def agreeable(agreeable_head: tuple[Path, Path]) -> Path:
    """A tiny model whose first layers + head draft it well (layers >= 1 scaled down;
    ``tests/head_fixtures.py``, shared with ``tests/test_head_ring.py``)."""
    return agreeable_head[0]


@pytest.fixture(scope="module")
def head_dir(agreeable_head: tuple[Path, Path]) -> Path:
    """A draft head trained for seconds on ``agreeable`` (shared with
    ``tests/test_head_ring.py``)."""
    return agreeable_head[1]


@pytest.fixture(scope="module")
def local_refs(agreeable: Path) -> dict[str, list[int]]:
    """`shard generate --local --json` on ``agreeable`` for every prompt of the module, in one
    process: each prompt's reference token ids."""
    prompts = (*PROMPTS, *GUESSABLE)
    local = trio.run(partial(run_python, _LOCAL, str(agreeable), *prompts, timeout_s=RUN_S))
    assert local.returncode == 0, local.describe()
    records = local.json_records()
    assert len(records) == len(prompts)
    return {p: r["token_ids"] for p, r in zip(prompts, records, strict=True)}


def speculative_spec(path: Path, model_dir: Path, speculation: str) -> Path:
    write_spec(
        path,
        model_dir=model_dir,
        blocks=[(0, 1), (1, 3), (3, 4)],
        limits={"max_len": MAX_LEN, "connect_timeout_s": 5.0},
    )
    with path.open("a", encoding="utf-8") as f:
        f.write("\n[speculation]\n" + speculation + "\n")
    return path


def check_same_or_tie(
    model_dir: Path, prompt_ids: list[int], got: list[int], want: list[int]
) -> int:
    """Equal (0), or diverging only where the reference's top-two logits are a numerical tie
    (1); anything else fails."""
    if got == want:
        return 0
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert i is not None, f"differ in length only: {got} vs {want}"
    config = ModelConfig.from_dir(model_dir)
    gaps: list[float] = []
    generate_reference(
        load_stage(model_dir, 0, config.n_layers),
        prompt_ids,
        max_tokens=i + 1,
        eos_ids=(),
        max_len=MAX_LEN,
        gaps=gaps,
    )
    assert gaps[i] < TIE, f"token {i} differs where the top-two gap is {gaps[i]:.3g}: not a tie"
    return 1


@pytest.mark.parametrize(
    "speculation",
    [
        'draft = "model"\ndraft_layers = 2\nk = 3\ndepth = 2',
        'draft = "auto"\ndraft_layers = 2\nk = "auto"\ndepth = "auto"',
        'draft = "ngram"\nk = 4\ndepth = 3',
        'draft = "hybrid"\ndraft_head = "{head}"\nk = 3\ndepth = 2',
    ],
    ids=["model-k3-d2", "auto-adaptive", "ngram-k4-d3", "hybrid-head-k3-d2"],
)
async def test_speculative_swarm_run_matches_local(
    agreeable: Path,
    local_refs: dict[str, list[int]],
    tmp_path: Path,
    speculation: str,
    request: pytest.FixtureRequest,
) -> None:
    """Multi-process speculative, pipelined decoding gives the reference's tokens (the
    hybrid: the tail's features cross real processes to the coordinator's head)."""
    if "{head}" in speculation:
        speculation = speculation.replace("{head}", str(request.getfixturevalue("head_dir")))
    spec = speculative_spec(tmp_path / "spec.toml", agreeable, speculation)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompts", str(prompts_file),
        "--max-tokens", str(MAX_TOKENS), "--model", str(agreeable), timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    records = done.json_records()
    assert len(records) == len(PROMPTS)
    tokenizer = Tokenizer.from_dir(agreeable)
    for prompt, record in zip(PROMPTS, records, strict=True):
        check_same_or_tie(
            agreeable, tokenizer.encode(prompt), record["token_ids"], local_refs[prompt]
        )
    assert sum(r["stats"]["drafted"] for r in records) > 0
    if '"model"' in speculation or '"auto"' in speculation:  # a good draft for this model
        assert sum(r["stats"]["accepted"] for r in records) > 0


async def test_swarm_run_receipt_verifies_offline(agreeable: Path, tmp_path: Path) -> None:
    """`swarm run --receipt` writes a signed receipt that `shard receipt verify` accepts, and
    one altered byte makes it fail with a reason."""
    spec = speculative_spec(tmp_path / "spec.toml", agreeable, 'draft = "ngram"')
    out = tmp_path / "run.json"
    done = await run_shard(
        "swarm", "run", str(spec), "--prompt", PROMPTS[0], "--max-tokens", "12",
        "--model", str(agreeable), "--receipt", str(out), timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    ok = await run_shard("receipt", "verify", str(out), timeout_s=60)
    assert ok.returncode == 0, ok.describe()
    assert "receipt OK" in ok.stdout
    assert "signers NOT pinned" in ok.stdout  # an insecure swarm's ephemeral keys
    data = json.loads(out.read_text())
    assert [(s["first"], s["last"]) for s in data["stages"]] == [(0, 1), (1, 3), (3, 4)]
    data["stages"][1]["output_chain"] = "0" * 64
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")  # canonical, but altered
    bad = await run_shard("receipt", "verify", str(out), timeout_s=60)
    assert bad.returncode == 1
    assert "INVALID" in bad.stderr


@pytest.mark.parametrize("pairs", k_depth_params("K and D per request through processes"))
@pytest.mark.parametrize(
    "speculation",
    [
        'draft = "ngram"',
        # K and D asked per request cross the processes the same way whatever drafts; the
        # whole grid per draft is in process (tests/test_speculation_ring.py,
        # tests/test_head_ring.py).
        pytest.param(
            'draft = "model"\ndraft_layers = 2',
            marks=pytest.mark.extended(
                covered_by="test_speculation_ring.py::test_greedy_identical_for_every_k_and_depth"
                "[model-cover], test_speculative_swarm_run_matches_local[model-k3-d2] (processes),"
                " this test's [ngram-cover] (K and D per request through processes)"
            ),
        ),
        pytest.param(
            'draft = "head"\ndraft_head = "{head}"',
            marks=pytest.mark.extended(
                covered_by="test_head_ring.py::test_greedy_identical_for_every_k_and_depth"
                "[head-cover], this test's [hybrid-cover] (the head drafting from features that"
                " cross processes)"
            ),
        ),
        'draft = "hybrid"\ndraft_head = "{head}"',
    ],
    ids=["ngram", "model", "head", "hybrid"],
)
async def test_swarm_greedy_identical_for_every_k_and_depth(
    agreeable: Path,
    local_refs: dict[str, list[int]],
    tmp_path: Path,
    speculation: str,
    pairs: tuple[tuple[int, int], ...],
    report: Callable[[str], None],
    request: pytest.FixtureRequest,
) -> None:
    """Through a running swarm of processes (`shard swarm up`), each (K, D) of ``pairs`` (K in
    1..8, D in 1..4), asked per request, gives the reference's tokens (or diverges only at a
    checked tie); for the head and the hybrid the tail's features cross real processes to the
    coordinator."""
    prompts = PROMPTS if "draft_layers" in speculation else GUESSABLE
    if "{head}" in speculation:
        speculation = speculation.replace("{head}", str(request.getfixturevalue("head_dir")))
    path = speculative_spec(tmp_path / "spec.toml", agreeable, speculation)
    spec = load_spec(path)
    refs = [local_refs[p] for p in prompts]
    tokenizer = Tokenizer.from_dir(agreeable)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    drafted = accepted = runs = deepest = ties = 0
    async with started_shard("swarm", "up", str(path), stderr_path=tmp_path / "up.log") as up:
        with trio.fail_after(RUN_S):
            await LineReader(up.stdout).line_starting("SHARD SWARM UP")
        async with client_network(spec) as network:

            async def one(i: int, k: int, depth: int) -> None:
                nonlocal runs, drafted, accepted, deepest, ties
                runs += 1
                req = GenerateRequest(runs, prompts[i], MAX_TOKENS, k=k, depth=depth)
                with trio.fail_after(60):
                    done = await ask_swarm(
                        network, str(spec.coordinator.listen), req, swarm=spec.name
                    )
                assert done.finish_reason != "error", (k, depth, done.error)
                ties += check_same_or_tie(agreeable, prompt_ids[i], list(done.token_ids), refs[i])
                drafted += done.stats.drafted
                accepted += done.stats.accepted
                assert done.stats.max_depth <= depth, (k, depth, done.stats)
                deepest = max(deepest, done.stats.max_depth)

            for k, depth in pairs:
                async with trio.open_nursery() as nursery:  # the prompts side by side
                    for i in range(len(prompts)):
                        nursery.start_soon(one, i, k, depth)
    assert runs == len(pairs) * len(prompts)
    assert drafted > 0 and deepest > 1  # drafts were verified, and chunks were pipelined
    assert accepted > 0  # and some were right (the head's: from features across processes)
    draft = speculation.split('"')[1]
    report(
        f"swarm of processes, draft={draft}, {len(pairs)} (K, D) pairs: numerical ties {ties} "
        f"of {runs}, drafts accepted {accepted} of {drafted}"
    )

"""Speculative decoding and receipts with real processes: ``shard swarm run`` with drafts and
pipelined chunks equals ``shard generate --local``, and its signed receipt verifies offline.

Charter as in ``test_swarm_cli``: loopback only, free ports, every process killed by PID.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from procs import run_python, run_shard, write_spec
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.reference import generate_reference
from shard.testing import scale_upper_layers

pytestmark = pytest.mark.slow

PROMPTS = ("in in in the the river river", "Hello, world! Hello, world! Hello")
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
def agreeable(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny model whose first two layers + head draft it well (layers >= 2 scaled down)."""
    base = tiny_checkpoint(seed=8, n_layers=4)
    return scale_upper_layers(
        base, tmp_path_factory.mktemp("agree") / "m", from_layer=2, factor=0.1
    )


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
) -> None:
    """Equal, or diverging only where the reference's top-two logits are a numerical tie."""
    if got == want:
        return
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


@pytest.mark.parametrize(
    "speculation",
    [
        'draft = "model"\ndraft_layers = 2\nk = 3\ndepth = 2',
        'draft = "auto"\ndraft_layers = 2\nk = "auto"\ndepth = "auto"',
        'draft = "ngram"\nk = 4\ndepth = 3',
    ],
    ids=["model-k3-d2", "auto-adaptive", "ngram-k4-d3"],
)
async def test_speculative_swarm_run_matches_local(
    agreeable: Path, tmp_path: Path, speculation: str
) -> None:
    """Multi-process speculative, pipelined decoding gives the reference's tokens."""
    spec = speculative_spec(tmp_path / "spec.toml", agreeable, speculation)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    local = await run_python(_LOCAL, str(agreeable), *PROMPTS, timeout_s=RUN_S)
    assert local.returncode == 0, local.describe()
    refs = local.json_records()
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompts", str(prompts_file),
        "--max-tokens", str(MAX_TOKENS), "--model", str(agreeable), timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    records = done.json_records()
    assert len(records) == len(PROMPTS)
    from shard.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(agreeable)
    for prompt, record, ref in zip(PROMPTS, records, refs, strict=True):
        check_same_or_tie(
            agreeable, tokenizer.encode(prompt), record["token_ids"], ref["token_ids"]
        )
    assert sum(r["stats"]["drafted"] for r in records) > 0
    if "ngram" not in speculation:  # the model draft agrees with this tuned model often
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
    data = json.loads(out.read_text())
    assert [(s["first"], s["last"]) for s in data["stages"]] == [(0, 1), (1, 3), (3, 4)]
    data["stages"][1]["output_chain"] = "0" * 64
    out.write_text(json.dumps(data))
    bad = await run_shard("receipt", "verify", str(out), timeout_s=60)
    assert bad.returncode == 1
    assert "INVALID" in bad.stderr

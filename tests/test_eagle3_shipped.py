"""The EAGLE-3 head shipped for SmolLM2 (``smollm2-eagle3``, the drafter of
``specs/local.toml``): it loads through the published-layout loader with the target's
embedding, fits the bundled SmolLM2, says how it was made, and greedy speculation with it on
the real model gives exactly the plain output while many of its drafts are accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shard.decode.head.eagle3 import Eagle3Head, target_embedding
from shard.decode.head.shipped import shipped_head
from shard.decode.hybrid import HybridProposer
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.nodes.drafter import make_drafter
from shard.spec.swarm import SwarmSpec, load_spec
from shard.spec.validate import SpecError
from test_eagle3 import speculate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
HEAD = shipped_head("smollm2-eagle3")


@pytest.fixture(scope="module")
def head(smollm2_dir: Path) -> Eagle3Head:
    assert HEAD is not None, "the shipped head is missing from the package"
    loaded = Eagle3Head.load(HEAD, embedding=target_embedding(smollm2_dir))
    loaded.config.check_target(ModelConfig.from_dir(smollm2_dir))
    return loaded


def test_the_shipped_head_says_how_it_was_made() -> None:
    assert HEAD is not None
    report = json.loads((HEAD / "train.json").read_text(encoding="utf-8"))
    assert report["target"].startswith("smollm2")
    assert report["data"]["tokens_held"] >= 500_000
    assert report["layers"] == [2, 15, 27]
    assert not (HEAD / "embed_tokens.safetensors").exists()


def test_local_spec_drafts_with_the_hybrid_over_the_shipped_head(smollm2_dir: Path) -> None:
    spec = load_spec(REPO / "specs/local.toml")
    assert spec.speculation.draft == "hybrid"
    assert spec.speculation.draft_head == str(HEAD)
    drafter = make_drafter(spec, smollm2_dir)
    assert drafter is not None
    proposer = drafter.session([1, 2, 3])
    assert isinstance(proposer, HybridProposer)
    assert proposer.feature_layers == (2, 15, 27)


def test_speculation_with_the_shipped_head_is_lossless_on_smollm2(
    head: Eagle3Head, smollm2_dir: Path
) -> None:
    target = load_stage(smollm2_dir, 0, 30)
    tok = Tokenizer.from_dir(smollm2_dir)
    text = "Write a short story about a fox who learns to sail."
    prompt = tok.encode(tok.apply_chat([{"role": "user", "content": text}]))
    n = 32
    # the plain output by the arithmetic ``speculate`` verifies with: the whole context in one
    # forward (more than 16 rows attend at once). Decode steps attend row by row, the last
    # bits differ, and at a near tie the two plain orders part: at token 25 here the steps'
    # logits are 14.6997 against 14.6950, the whole context's 14.7998 against 14.7095 the
    # other way. The ring's verify chunks equal its decode steps bit for bit (tests/
    # test_quant_ring.py); this one-process helper is not the ring.
    want: list[int] = []
    for _ in range(n):
        context = prompt + want
        logits = target(torch.tensor([context]), 0, target.new_cache(len(context)))
        want.append(int(logits[0, -1].argmax()))
    got, drafted, accepted = speculate(target, head, prompt, n, k=3)
    assert got == want
    # 18 of 42 here; a random head's drafts are all but never accepted
    assert accepted >= 0.25 * drafted


def test_an_eagle3_draft_on_smollm2_defaults_to_the_shipped_head(tmp_path: Path) -> None:
    """``draft = "eagle3"`` with no ``draft_head`` on the bundled SmolLM2 reads the shipped
    head; the hybrid and the plain head may name it; a name nothing ships is refused."""

    def spec(speculation: dict[str, str]) -> SwarmSpec:
        data = {
            "swarm": {"name": "e", "model": "smollm2", "insecure": True},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9300"},
            "stage": [{"name": "s0", "listen": "127.0.0.1:9301"}],
            "speculation": speculation,
        }
        return SwarmSpec.from_dict(data, source="spec.toml", base_dir=tmp_path)

    assert spec({"draft": "eagle3"}).speculation.draft_head == str(HEAD)
    for draft in ("hybrid", "head"):
        named = spec({"draft": draft, "draft_head": "smollm2-eagle3"})
        assert named.speculation.draft_head == str(HEAD)
    with pytest.raises(SpecError, match="not an EAGLE-3 head directory"):
        spec({"draft": "eagle3", "draft_head": "gemma3-270m-eagle3"})

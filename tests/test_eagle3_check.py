"""Which target layers feed an EAGLE-3 head: a head trained (here, for seconds) on the
target's states entering layers (2, 4, 5) passes the check when its config declares them, and
is caught when its config is off by one either way; speculation with it accepts drafts and
stays lossless.

The target is a tiny random model, whose greedy continuations are chaotic: a head trained for
seconds memorizes its text and generalizes little (on other text its log-probability of the
target's token is below uniform's whatever the layers). So the check and the speculation run
on the text it was trained on. What the check measures, which layers' states the head fits,
is the same on any text; with a real head it runs on real prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.eagle3_check import (
    Eagle3LayerMismatch,
    check_layers,
    require_layers,
    target_states,
)
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.testing import make_tiny_checkpoint
from shard.testing.eagle3 import eagle3_config, write_eagle3_head
from test_eagle3 import plain_greedy, speculate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LAYERS = 8
TRUE = (2, 4, 5)  # the published default for 8 layers: (2, L // 2, L - 3)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> StageModel:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t"), seed=2, n_layers=LAYERS)
    return load_stage(path, 0, LAYERS)


@pytest.fixture(scope="module")
def text(target: StageModel) -> list[list[int]]:
    """64 rows of 32 tokens: 4 random ones (seeded), then the target's greedy continuation."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, target.config.vocab_size, (64, 4), generator=gen)
    cache = target.new_cache(32, batch=64)
    with torch.inference_mode():
        logits = target(rows, 0, cache)[:, -1]  # [64, V]
        while rows.shape[1] < 32:
            rows = torch.cat((rows, logits.argmax(-1, keepdim=True)), dim=1)
            logits = target(rows[:, -1:], rows.shape[1] - 1, cache)[:, -1]
    out: list[list[int]] = rows.tolist()
    return out


@pytest.fixture(scope="module")
def trained(
    target: StageModel, text: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    """A head's tensors (published names) trained on the target's states at ``TRUE``: 400
    Adam steps of cross-entropy on the target's greedy token over ``text``, fixed seeds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(target, text, tmp_path_factory.mktemp("untrained"))
    finally:
        torch.set_num_threads(before)


def _train(target: StageModel, text: list[list[int]], root: Path) -> dict[str, torch.Tensor]:
    c = target.config
    assert target.embed_tokens is not None
    config = eagle3_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, draft_vocab_size=c.vocab_size
    )
    head = Eagle3Head.load(write_eagle3_head(root, config, embedding=target.embed_tokens.weight))
    with torch.no_grad():
        head.lm_head.weight.mul_(0.05)  # start near uniform: the written head is sharp
    head.train()
    data = [target_states(target, torch.tensor(r), TRUE) for r in text]
    states = torch.stack([s for s, _ in data])  # [N, S, 3D]
    greedy = torch.stack([g for _, g in data])  # [N, S]
    ids = torch.tensor(text)
    head.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        pick = torch.randint(0, len(text), (16,), generator=gen)
        g = head(states[pick, :-1], ids[pick, 1:])  # [16, S-1, D]
        loss = F.cross_entropy(head.logits(g).flatten(0, 1), greedy[pick, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: t.detach().clone() for n, t in head.state_dict().items()}


def declaring(
    target: StageModel, tensors: dict[str, torch.Tensor], layers: Sequence[int], path: Path
) -> Eagle3Head:
    """The trained head, its config declaring ``layers``."""
    c = target.config
    config = eagle3_config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        draft_vocab_size=c.vocab_size,
        layer_ids=layers,
    )
    return Eagle3Head.load(write_eagle3_head(path, config, tensors=tensors))


def test_a_head_declaring_its_layers_passes(
    target: StageModel, text: list[list[int]], trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Trained on (2, 4, 5) and declaring them: those layers score best, by a clear margin."""
    head = declaring(target, trained, TRUE, tmp_path / "h")
    result = require_layers(head, target, text[:6])
    print(result)
    assert result.ok and result.best == TRUE
    scores = dict(result.scores)
    assert scores[TRUE] > max(s for c, s in result.scores if c != TRUE) + 0.5


@pytest.mark.parametrize("declared", [(1, 3, 4), (3, 5, 6)], ids=["one-below", "one-above"])
def test_a_head_off_by_one_is_caught(
    target: StageModel,
    text: list[list[int]],
    trained: dict[str, torch.Tensor],
    tmp_path: Path,
    declared: tuple[int, ...],
) -> None:
    """Trained on (2, 4, 5) but declaring the layers one below (SpecForge's output-named ids
    where vLLM reads input-named ones) or one above: the check names (2, 4, 5)."""
    head = declaring(target, trained, declared, tmp_path / "h")
    result = check_layers(head, target, text[:6])
    print(result)
    assert not result.ok and result.best == TRUE
    with pytest.raises(Eagle3LayerMismatch, match=r"\[2, 4, 5\]"):
        require_layers(head, target, text[:6])


def test_speculation_with_the_trained_head_accepts_drafts_and_is_lossless(
    target: StageModel, text: list[list[int]], trained: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """With the head that fits, drafts are accepted, and the output is plain greedy's."""
    head = declaring(target, trained, TRUE, tmp_path / "h")
    for row in text[:2]:
        out, drafted, accepted = speculate(target, head, row[:8], 16, 3)
        assert out == plain_greedy(target, row[:8], 16)
        print(f"drafted {drafted}, accepted {accepted}")
        assert accepted > 0

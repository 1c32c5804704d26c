"""Qwen3-Next and Qwen3.5-MoE: what the shared family tests cannot see — rollback of a state.

``test_model_families`` and ``test_family_ring`` run both families like every other (logits
and greedy ids against transformers, every split, packed rows, 8 sessions with and without
speculation, a ring of processes). Here: a Gated DeltaNet layer keeps a recurrent state that
cannot be cut back to a position (``shard.model.recurrent``), so everything that rolls a
session back is checked against an uninterrupted run — a rejected verify chunk (bit for bit:
the steps after it equal a run that never saw it), rollbacks across and before a snapshot,
an audit's replay of chunks that include rejected ones, a failover splice onto a standby in
a ring with speculation; a rollback deeper than kept, or a chunk that skips positions, is
refused, never computed from a wrong state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import family_fixtures
from shard.audit.auditor import recompute
from shard.compute.tensors import to_wire
from shard.coordinator.coordinator import Completion
from shard.decode.reference import generate_reference
from shard.messages import ChunkSeq, Epoch, NodeName, Prefill, Sampling, SessionId
from shard.messages.audit import AuditedChunk
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.footprint import predict
from shard.model.loader import load_stage
from shard.model.recurrent import EVERY, ROLLBACK, RecurrentRollbackError, recurrent_bytes
from shard.spec.audit import AuditSpec
from shard.stage.chunks import Session, StageFailed, kv_refusal, plan
from shard.testing.faults import FaultPlan
from test_audit_wired import _run as run_audited
from test_failover import DECODE, MAX_TOKENS, PROMPTS, failover_spec, run_scenario

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

#: 40 positions: a rollback into it crosses the snapshot after position 31 (``EVERY`` 32).
PROMPT = [(13 * i + 7) % 250 + 1 for i in range(40)]
SPECS = Path(__file__).resolve().parents[1] / "specs" / "models"


def _steps(model: Any, cache: Any, ids: list[int], start: int) -> torch.Tensor:
    """Logits of ``ids`` fed one decode step at a time from ``start``: ``[len(ids), V]``."""
    return torch.cat([model(torch.tensor([[t]]), start + i, cache)[0] for i, t in enumerate(ids)])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
@pytest.mark.parametrize("back", [0, 1, 8, 9, 39])
def test_steps_after_a_rejected_chunk_equal_an_uninterrupted_run(
    family_checkpoint: Callable[[str], Path], family: str, back: int
) -> None:
    """The session runs on ``back`` positions past 40 - ``back`` and then a verify chunk of
    5 drafts, all rejected; decoding resumes at 40 - ``back``. Every following step's logits
    equal, bit for bit, those of a run that never went past it: the state is rebuilt from
    the snapshot after position 31 (or from zeros before it) and the kept steps, not from
    the discarded ones."""
    model = load_stage(family_checkpoint(family), 0, 4)
    at, resume = len(PROMPT) - back, [33, 200, 7, 7, 150, 2]
    clean, rolled = model.new_cache(64), model.new_cache(64)
    model(torch.tensor([PROMPT[:at]]), 0, clean)
    model(torch.tensor([PROMPT[:at]]), 0, rolled)  # the same chunk: the same bits up to ``at``
    if back:
        model(torch.tensor([PROMPT[at:]]), at, rolled)  # ran on past ``at`` ...
    model(torch.tensor([[250, 1, 77, 3, 9]]), len(PROMPT), rolled)  # ... and a rejected chunk
    assert torch.equal(_steps(model, rolled, resume, at), _steps(model, clean, resume, at))


def test_a_verify_chunk_equals_its_decode_steps(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """A chunk of 6 rows gives its 6 decode steps' logits (the recurrence runs position by
    position either way; only the dense products see 6 rows): within float noise in
    float32, greedy ids equal; bit for bit with int8 weights (row-invariant kernels)."""
    model_dir, draft = family_checkpoint("qwen3_next"), [44, 45, 46, 47, 48, 49]
    worst = 0.0
    for weights in (None, "int8"):
        model = load_stage(model_dir, 0, 4, weights=weights)
        a, b = model.new_cache(64), model.new_cache(64)
        model(torch.tensor([PROMPT]), 0, a)
        model(torch.tensor([PROMPT]), 0, b)
        chunk = model(torch.tensor([draft]), len(PROMPT), a)[0]
        steps = _steps(model, b, draft, len(PROMPT))
        if weights is None:
            worst = float((chunk - steps).abs().max())
            assert worst < 1e-4 and torch.equal(chunk.argmax(-1), steps.argmax(-1))
        else:
            assert torch.equal(chunk, steps)
    report(f"qwen3_next: verify chunk vs decode steps: fp32 {worst:.2g}, int8 bit-identical")


def test_a_rollback_deeper_than_kept_or_a_gap_is_refused(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """A chunk starting more than ``ROLLBACK`` positions behind the last one written, or past
    it, is refused with ``RecurrentRollbackError``; the session's state is left as it was."""
    model = load_stage(family_checkpoint("qwen3_next"), 0, 2)
    n = ROLLBACK + 2 * EVERY
    cache = model.new_cache(n + 8)
    model(torch.tensor([[(7 * i) % 250 + 1 for i in range(n)]]), 0, cache)
    with pytest.raises(RecurrentRollbackError, match="rolls back"):
        model(torch.tensor([[5]]), n - ROLLBACK - 1, cache)
    with pytest.raises(RecurrentRollbackError, match="skips positions"):
        model(torch.tensor([[5]]), n + 1, cache)
    model(torch.tensor([[5]]), n - ROLLBACK, cache)  # the deepest kept rollback runs


def test_a_session_sent_again_from_its_start_needs_nothing_kept(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """A session far past ``ROLLBACK`` sent again from position 0 (the coordinator's full
    re-send) runs from zeros: its logits equal a fresh session's, bit for bit."""
    model = load_stage(family_checkpoint("qwen3_next"), 0, 4)
    long = [(11 * i + 3) % 250 + 1 for i in range(ROLLBACK + 40)]
    cache, fresh = model.new_cache(ROLLBACK + 48), model.new_cache(ROLLBACK + 48)
    model(torch.tensor([long]), 0, cache)
    x = torch.tensor([PROMPT])
    assert torch.equal(model(x, 0, cache), model(x, 0, fresh))


def test_a_stage_refuses_a_rollback_deeper_than_kept_as_a_gap(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """A chunk more than ``ROLLBACK`` positions behind what a linear-attention stage wrote is
    refused before it runs, as a "gap" (the coordinator then sends the session again from
    position 0); an attention-only stage of the same model takes it (its KV is cut by
    position); a chunk from position 0 is always taken."""
    model_dir = family_checkpoint("qwen3_next")
    linear, attention = load_stage(model_dir, 0, 2), load_stage(model_dir, 1, 2)
    for stage, refused in ((linear, True), (attention, False)):
        sess = Session(stage.new_cache(ROLLBACK + 48), Sampling(), written=ROLLBACK + 40)
        sessions = {SessionId(1): sess}
        chunk = Prefill(SessionId(1), Epoch(0), ChunkSeq(0), 20, False, ids=(5, 6))
        if not stage.is_first:
            chunk = attrs.evolve(chunk, ids=(), hidden=to_wire(torch.zeros(1, 2, 64)))
        if refused:
            with pytest.raises(StageFailed, match="rolls back 148 positions") as err:
                plan(stage, NodeName("s"), sessions, chunk, 0.0)
            assert err.value.kind == "gap"
        else:
            plan(stage, NodeName("s"), sessions, chunk, 0.0)
        sess.written = ROLLBACK + 40
        plan(stage, NodeName("s"), sessions, attrs.evolve(chunk, start=0), 0.0)


def test_an_audit_replay_through_rejected_chunks_equals_the_stage(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """The auditor's ``recompute`` replays a session's chunks — prefill, a verify chunk whose
    drafts were all rejected, the verify chunk that started inside it — into a fresh cache
    and gets the audited chunk's output bit for bit; the resumed chunk's logits equal a run
    without the rejected chunk within float noise, with the same greedy ids."""
    model = load_stage(family_checkpoint("qwen3_next"), 0, 4)
    n = len(PROMPT)
    prior = (
        AuditedChunk(epoch=0, seq=0, start=0, ids=tuple(PROMPT), final=True),
        AuditedChunk(epoch=0, seq=1, start=n, ids=(9, 250, 1, 77), verify=True, draft=(250, 1, 77)),
    )  # fmt: skip
    chunk = AuditedChunk(epoch=0, seq=2, start=n + 1, ids=(3, 40, 41), verify=True, draft=(40, 41))
    live = model.new_cache(64)
    model(torch.tensor([PROMPT]), 0, live, head_rows=1)
    model(torch.tensor([[9, 250, 1, 77]]), n, live, head_rows=4)
    claimed = model(torch.tensor([[3, 40, 41]]), n + 1, live, head_rows=3)
    assert torch.equal(recompute(model, prior, chunk), claimed)
    plain = model.new_cache(64)
    model(torch.tensor([[*PROMPT, 9]]), 0, plain)
    want = model(torch.tensor([[3, 40, 41]]), n + 1, plain)
    torch.testing.assert_close(claimed, want, rtol=0, atol=1e-4)
    assert torch.equal(claimed.argmax(-1), want.argmax(-1))


def _local_runs(model_dir: Path) -> list[tuple[int, ...]]:
    """``generate --local`` of each of the failover harness's ``PROMPTS``, as it runs them."""
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    return [
        generate_reference(
            model, list(p), eos_ids=config.eos_token_ids, max_tokens=MAX_TOKENS,
            prefill_chunk=4, max_len=96,
        ).token_ids
        for p in PROMPTS
    ]  # fmt: skip


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_a_killed_stage_is_spliced_onto_its_standby_with_identical_output(
    family_checkpoint: Callable[[str], Path], speculate: bool
) -> None:
    """Stage s1 of a three-stage Qwen3-Next ring (each stage one DeltaNet and one gated
    attention layer) is killed mid-decode; its hot standby replays the sessions' committed
    tokens into a fresh state and takes over, and each request's tokens equal the local
    plain run — with speculation too, whose rejected drafts roll every stage's state back."""
    model_dir = family_checkpoint("qwen3_next_6")
    want = _local_runs(model_dir)
    plan = FaultPlan.random(3800 + speculate, kind="kill", node="s1", frames=DECODE)
    out = run_scenario(failover_spec(model_dir, speculate=speculate), model_dir, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    assert [(r.kind, r.lost) for r in out.recoveries] == [("hot", "s1")], out.recoveries
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == want[i], f"{plan}: request {i} output differs"


def test_spot_checks_of_a_speculative_ring_find_every_honest_stage_honest(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """Every chunk of every stage of a speculative Qwen3-Next ring is audited (rate 1): each
    auditor replays the session's chunks — rejected drafts, rollbacks and all — into a fresh
    state and agrees with every honest stage; no one is struck, and the outputs equal the
    local plain run."""
    model_dir = family_checkpoint("qwen3_next_6")
    want = _local_runs(model_dir)
    spec = failover_spec(model_dir, speculate=True)
    spec = attrs.evolve(spec, audit=AuditSpec(enabled=True, rate=1.0))
    rounds, stats, verdicts, _ = run_audited(spec, model_dir, "s1", "none")
    assert verdicts and all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
    assert stats.audits.evictions == 0
    assert {v.accused for v in verdicts} == {"s0", "s1", "s2"}
    for r in rounds:
        assert not r.errors and r.outputs == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sessions_state_is_priced_and_does_not_grow(
    family_checkpoint: Callable[[str], Path], dtype: torch.dtype
) -> None:
    """A stage's cache holds KV for its attention layers only, and per linear layer a state
    whose bytes do not depend on the session's length; footprint's pricing and the stage's
    admission agree with what is allocated."""
    model_dir = family_checkpoint("qwen3_next")
    config = ModelConfig.from_dir(model_dir)
    la = config.linear_attn
    assert la is not None
    elem = torch.empty((), dtype=dtype).element_size()
    stage = load_stage(model_dir, 0, 3, dtype=dtype)  # linear, full, linear
    short, long = stage.new_cache(50), stage.new_cache(100)
    state = long.recurrent.nbytes if long.recurrent is not None else 0
    assert state == short.nbytes - 50 * config.kv_elements * elem
    assert long.nbytes - short.nbytes == 50 * config.kv_elements * elem  # one attention layer
    one = recurrent_bytes(
        heads=la.n_v_heads, k_dim=la.k_head_dim, v_dim=la.v_head_dim, conv_dim=la.conv_dim,
        kernel=la.conv_kernel, elem=elem,
    )  # fmt: skip
    assert state == 2 * one
    footprint = predict(config, "bfloat16" if dtype == torch.bfloat16 else "float32")
    assert footprint.kv(0, 3, 100) + footprint.state(0, 3) == long.nbytes
    assert kv_refusal(stage, 100, 0, long.nbytes) is None
    assert kv_refusal(stage, 101, 0, long.nbytes) is not None


def test_a_stage_of_linear_layers_only_keeps_no_kv(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """Layers 2 and 3 are both DeltaNet layers: their stage's KV part is empty, and running
    it from the hidden states of layers [0, 2) gives the whole model's logits bit for bit."""
    model_dir = family_checkpoint("qwen3_next")
    head, tail, whole = (load_stage(model_dir, a, b) for a, b in ((0, 2), (2, 4), (0, 4)))
    cache = tail.new_cache(48)
    assert cache.k.shape[0] == 0 and cache.recurrent is not None
    x = torch.tensor([PROMPT])
    got = tail(head(x, 0, head.new_cache(48)), 0, cache)
    assert torch.equal(got, whole(x, 0, whole.new_cache(48)))


BAD = [
    ({"linear_num_value_heads": 3}, "linear_num_value_heads must be a multiple"),
    ({"linear_num_key_heads": 0}, "linear_num_key_heads must be an integer in"),
    ({"linear_conv_kernel_dim": 1 << 20}, "linear_conv_kernel_dim must be an integer in"),
    ({"linear_key_head_dim": "8"}, "linear_key_head_dim must be an integer"),
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
     "layer_types must be 4 of"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must be 4 of"),
    ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in"),
    ({"partial_rotary_factor": 2, "rope_parameters": None}, "partial_rotary_factor must be"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_fields_are_refused_in_one_line(
    family_checkpoint: Callable[[str], Path], change: dict[str, Any], message: str
) -> None:
    """Each malformed or out-of-range Qwen3-Next field: a one-line ModelLoadError naming it."""
    d = json.loads((family_checkpoint("qwen3_next") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message) as err:
        ModelConfig.from_hf(d | change)
    assert "\n" not in str(err.value)


def test_linear_layers_are_refused_in_a_family_without_them(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """``linear_attention`` in another family's ``layer_types`` (Gemma 3's) is refused, not
    run as attention."""
    d = json.loads((family_checkpoint("gemma3") / "config.json").read_text())
    d["layer_types"] = ["linear_attention"] * d["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match="unknown layer_types"):
        ModelConfig.from_hf(d)


def test_a_draft_head_over_linear_attention_is_refused(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """The EAGLE-style head is built from Llama layers: over a Qwen3-Next target it is
    refused in one line rather than built wrong."""
    from shard.decode.head.model import HeadConfig, HeadError

    config = ModelConfig.from_dir(family_checkpoint("qwen3_next"))
    with pytest.raises(HeadError, match="linear-attention"):
        HeadConfig(target=config)


def test_the_published_qwen3_next_config_plans() -> None:
    """Qwen3-Next-80B-A3B's published config: 36 DeltaNet layers of 32 value heads of 128 x
    128 and 12 gated attention layers, 512 experts, a quarter of each head rotated."""
    config = ModelConfig.from_dir(SPECS / "qwen3-next-80b-a3b")
    assert config.linear_attn is not None and config.moe is not None
    assert sum(map(config.is_linear, range(48))) == 36
    assert config.linear_attn.state_elements == 32 * 128 * 128
    assert (config.moe.n_experts, config.moe.top_k, config.rotary_dim) == (512, 10, 64)
    footprint = predict(config, "bfloat16")
    assert footprint.kv(0, 48) == 12 * 2 * 2 * 256 * 2  # bytes a token: 12 layers' K and V

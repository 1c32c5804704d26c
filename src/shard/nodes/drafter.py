"""The coordinator's draft proposers, built from the spec's ``[speculation]`` table: n-gram
lookup, a small model (the target truncated, or a distilled draft), both, a draft head on the
target's features alone or with the n-gram over long matches (``hybrid``), or the oracle of
a benchmark. Built once at start, in a worker thread (it may load a model, or train a named
head that is not built yet: ``resolve_head`` says so and shows its progress).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from shard.decode.draft import (
    AdaptiveProposer,
    Drafter,
    ModelProposer,
    NGramProposer,
    OracleProposer,
    Proposer,
)
from shard.decode.hybrid import HybridProposer
from shard.decode.tail import TailProposer, tail_draft_count
from shard.model.config import ModelConfig
from shard.model.device import emulated_dtype_note, resolve_device
from shard.model.llama import StageModel
from shard.model.loader import load_stage, load_truncated
from shard.nodes.stage import DTYPES
from shard.spec.swarm import SwarmSpec

log = logging.getLogger(__name__)


def make_drafter(spec: SwarmSpec, model_dir: Path) -> Drafter | None:
    """The coordinator's draft proposers, per the spec's ``[speculation]`` (None: plain)."""
    plan = spec.speculation
    if plan.draft == "none":
        return None
    if plan.draft == "eagle3" or (plan.uses_head and _eagle3_named(plan.draft_head)):
        return _eagle3_drafter(spec, model_dir)
    if plan.uses_head:
        return _head_drafter(spec)
    if plan.draft == "mtp":
        return _mtp_drafter(spec, model_dir)
    if plan.draft == "oracle":
        assert plan.oracle_file is not None
        references = json.loads(Path(plan.oracle_file).read_text())["references"]

        def oracle(prompt: Sequence[int]) -> Proposer:
            n = len(prompt)
            for ref in references:
                if ref[:n] == list(prompt):
                    return OracleProposer(ref)
            return OracleProposer([])  # no reference for this prompt: plain decoding

        return Drafter(oracle)
    model: StageModel | None = None
    if plan.uses_model:
        runtime = spec.runtime(spec.coordinator.name)  # the draft's device and dtype
        dtype = DTYPES[runtime.dtype or spec.dtype]
        device = resolve_device(runtime.device, spec.coordinator.name)
        if (note := emulated_dtype_note(spec.coordinator.name, device, dtype)) is not None:
            log.warning("%s", note)
        if plan.draft_model is not None:
            draft_dir = Path(plan.draft_model)
            layers = ModelConfig.from_dir(draft_dir).n_layers
            model = load_stage(draft_dir, 0, layers, dtype=dtype, device=device)
        else:
            model = load_truncated(model_dir, plan.draft_layers, dtype=dtype, device=device)

    def factory(prompt: Sequence[int]) -> Proposer:
        proposers: list[Proposer] = []
        if plan.draft in ("ngram", "auto"):
            proposers.append(NGramProposer())
        if model is not None:
            proposers.append(ModelProposer(model, max_len=spec.limits.max_len))
        return proposers[0] if len(proposers) == 1 else AdaptiveProposer(proposers)

    return Drafter(factory)


def _head_drafter(spec: SwarmSpec) -> Drafter:
    """``draft = "head"`` or ``"hybrid"``: the spec's head (built first if it is a name not
    built yet), on the coordinator's device, in fp32 (a head is small; its readout decides)."""
    from shard.decode.head.model import DraftHead
    from shard.decode.head.proposer import HeadProposer
    from shard.training.head.cache import resolve_head

    plan = spec.speculation
    assert plan.draft_head is not None
    device = resolve_device(spec.runtime(spec.coordinator.name).device, spec.coordinator.name)
    head = DraftHead.load(resolve_head(plan.draft_head, build=True), device=device)
    max_len = spec.limits.max_len

    def factory(prompt: Sequence[int]) -> Proposer:
        proposer = HeadProposer(head, max_len=max_len)
        if plan.draft == "hybrid":
            return HybridProposer(proposer, branch=plan.branch)
        return proposer

    return Drafter(factory, device=device)


def _eagle3_named(head: str | None) -> bool:
    from shard.decode.head.shipped import is_eagle3_dir

    return head is not None and is_eagle3_dir(Path(head))


def _eagle3_drafter(spec: SwarmSpec, model_dir: Path) -> Drafter:
    """``draft = "eagle3"``, or ``"head"``/``"hybrid"`` naming an EAGLE-3 head (the hybrid:
    the n-gram over long matches, the head elsewhere): the spec's EAGLE-3 head on the
    coordinator's device, in fp32,
    checked against the target (vocabulary, width, layers: ``Eagle3Error`` before the swarm
    starts). A head without ``embed_tokens`` gets the target's, read from the model's files
    (its first stage of one layer, dropped once the table is out). Each session asks the
    ring for the head's layers."""

    from shard.decode.head.eagle3 import Eagle3Head, target_embedding
    from shard.decode.head.eagle3_files import Eagle3NeedsEmbedding
    from shard.decode.head.proposer import HeadProposer

    plan = spec.speculation
    assert plan.draft_head is not None
    path = Path(plan.draft_head)
    device = resolve_device(spec.runtime(spec.coordinator.name).device, spec.coordinator.name)
    try:
        head = Eagle3Head.load(path, device=device)
    except Eagle3NeedsEmbedding:
        head = Eagle3Head.load(path, embedding=target_embedding(model_dir), device=device)
    target = ModelConfig.from_dir(model_dir)
    head.config.check_target(target)
    layers = head.config.layers_for(target.n_layers)
    log.info("EAGLE-3 head %s reads the states entering layers %s", path, list(layers))
    max_len = spec.limits.max_len
    hybrid = plan.draft == "hybrid"

    def factory(prompt: Sequence[int]) -> Proposer:
        proposer = HeadProposer(head, max_len=max_len, layers=layers)
        return HybridProposer(proposer, branch=plan.branch) if hybrid else proposer

    return Drafter(factory, device=device)


def _mtp_drafter(spec: SwarmSpec, model_dir: Path) -> Drafter:
    """``draft = "mtp"``: the checkpoint's first MTP block. At the tail (``mtp_at = "tail"``,
    the default) each session asks the tail for its drafts (``TailProposer``; the tail loads
    the block: ``shard.nodes.loading``); at the coordinator it runs here, on the
    coordinator's device in fp32 (``MtpError`` before the swarm starts when the checkpoint
    has none), fed the tail's final-norm features as a draft head is."""
    from shard.decode.head.mtp import MtpHead
    from shard.decode.head.proposer import HeadProposer

    plan = spec.speculation
    if plan.mtp_at_tail:
        count = tail_draft_count(plan.policy.k_max, plan.policy.depth_max)
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        log.info("drafting with the MTP block at the tail: %d drafts a verdict", count)
        return Drafter(lambda prompt: TailProposer(count, vocab))
    device = resolve_device(spec.runtime(spec.coordinator.name).device, spec.coordinator.name)
    head = MtpHead.load(model_dir, device=device)
    log.info("drafting with the MTP block of %s (layer %d)", model_dir, head.block.first)
    max_len = spec.limits.max_len
    return Drafter(lambda prompt: HeadProposer(head, max_len=max_len), device=device)


__all__ = ["make_drafter"]
